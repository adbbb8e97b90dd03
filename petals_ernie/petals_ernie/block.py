from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
    Ernie4_5_MoeDecoderLayer,
    Ernie4_5_MoeRotaryEmbedding,
)

from petals.block import RotaryBlockMixin


class Ernie4_5_MoeBlock(RotaryBlockMixin, Ernie4_5_MoeDecoderLayer):
    """One ERNIE 4.5 MoE layer: attention, then routed experts (chosen with a score correction bias)
    and shared experts on the layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` every
    ``moe_layer_interval``, a dense MLP on the others."""

    rotary_class = Ernie4_5_MoeRotaryEmbedding
