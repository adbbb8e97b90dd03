from transformers.models.cohere2.modeling_cohere2 import Cohere2DecoderLayer, Cohere2RotaryEmbedding

from petals.block import RotaryBlockMixin


class Cohere2Block(RotaryBlockMixin, Cohere2DecoderLayer):
    """One Command R7B / Command A layer: attention and the MLP side by side on one layer norm; the
    sliding layers rotate (interleaved pairs), the full-attention ones have no positions at all."""

    rotary_class = Cohere2RotaryEmbedding
