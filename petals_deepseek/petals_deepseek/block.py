from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RotaryEmbedding,
)

from petals.block import RotaryBlockMixin


class DeepseekV3Block(RotaryBlockMixin, DeepseekV3DecoderLayer):
    """One DeepSeek V3 layer: latent attention, then a dense MLP (the first ``first_k_dense_replace``
    layers) or shared and routed experts (group-limited routing)."""

    rotary_class = DeepseekV3RotaryEmbedding


class DeepseekV2Block(RotaryBlockMixin, DeepseekV2DecoderLayer):
    """One DeepSeek V2 layer: as V3's, with V2's router and rotary embedding."""

    rotary_class = DeepseekV2RotaryEmbedding
