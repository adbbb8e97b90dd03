import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDecoderLayer

from petals.block import RotaryBlockMixin, ServerBlockMixin
from petals.kv_cache import PagedCache
from petals_deepseek.absorbed import AbsorbedDeepseekV2Attention, AbsorbedDeepseekV3Attention


class AbsorbedAttentionMixin:
    """Serves the layer's attention absorbed into the cached latent where that is cheaper
    (``petals_deepseek.absorbed``)."""

    attention_class: type

    def __init__(self, config, block_index: int = 0) -> None:
        super().__init__(config, block_index)
        # the subclass adds no state at construction: retyping the attention the HF layer built avoids
        # building (and initializing) a second one
        self.self_attn.__class__ = self.attention_class


class DeepseekV3Block(AbsorbedAttentionMixin, RotaryBlockMixin, DeepseekV3DecoderLayer):
    """One DeepSeek V3 layer: latent attention, then a dense MLP (the first ``first_k_dense_replace``
    layers) or shared and routed experts (group-limited routing)."""

    rotary_class = DeepseekV3RotaryEmbedding
    attention_class = AbsorbedDeepseekV3Attention


class DeepseekV2Block(AbsorbedAttentionMixin, RotaryBlockMixin, DeepseekV2DecoderLayer):
    """One DeepSeek V2 layer: as V3's, with V2's router and rotary embedding."""

    rotary_class = DeepseekV2RotaryEmbedding
    attention_class = AbsorbedDeepseekV2Attention


class KimiLinearBlock(ServerBlockMixin, KimiLinearDecoderLayer):
    """One Kimi Linear layer: Kimi Delta Attention (a gated delta rule with per-channel decay, after a
    short convolution) or latent attention without positions (NoPE), as ``layer_types`` says for its
    index, then a dense MLP or shared and routed experts (``mlp_layer_types``)."""

    def forward(self, hidden_states: torch.Tensor, cache: PagedCache | None = None) -> torch.Tensor:
        position_ids = self.position_ids(hidden_states, cache)
        return super().forward(
            hidden_states,
            attention_mask=self.causal_mask(hidden_states, cache, position_ids),
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
