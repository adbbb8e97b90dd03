from transformers.models.granite.modeling_granite import GraniteDecoderLayer, GraniteRotaryEmbedding
from transformers.models.granitemoe.modeling_granitemoe import (
    GraniteMoeDecoderLayer,
    GraniteMoeRotaryEmbedding,
)

from petals.block import RotaryBlockMixin


class GraniteBlock(RotaryBlockMixin, GraniteDecoderLayer):
    """One Granite layer: Llama's, with ``attention_multiplier`` as the attention scale and
    ``residual_multiplier`` on both residual branches."""

    rotary_class = GraniteRotaryEmbedding


class GraniteMoeBlock(RotaryBlockMixin, GraniteMoeDecoderLayer):
    """One Granite MoE layer: Granite's attention and multipliers, then routed experts."""

    rotary_class = GraniteMoeRotaryEmbedding
