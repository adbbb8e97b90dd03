from transformers.models.exaone4.modeling_exaone4 import Exaone4DecoderLayer, Exaone4RotaryEmbedding

from petals.block import RotaryBlockMixin


class Exaone4Block(RotaryBlockMixin, Exaone4DecoderLayer):
    """One EXAONE 4.0 layer: attention with per-head q/k norms, normed after attention and after the
    MLP (not before); with a sliding window, its sliding layers rotate and its full-attention ones
    have no positions."""

    rotary_class = Exaone4RotaryEmbedding
