from transformers.models.lfm2.modeling_lfm2 import Lfm2DecoderLayer, Lfm2RotaryEmbedding

from petals.block import RotaryBlockMixin


class Lfm2Block(RotaryBlockMixin, Lfm2DecoderLayer):
    """One LFM2 layer: a gated short convolution (its last ``conv_L_cache`` inputs are its whole cache)
    or grouped-query attention with q/k norms, as ``layer_types`` says for its index, then a SwiGLU MLP."""

    rotary_class = Lfm2RotaryEmbedding
