import torch
from transformers.models.glm4.modeling_glm4 import Glm4DecoderLayer, Glm4RotaryEmbedding
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRotaryEmbedding
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaDecoderLayer,
    GlmMoeDsaRotaryEmbedding,
)

from petals.block import RotaryBlockMixin
from petals.kv_cache import PagedCache


class Glm4Block(RotaryBlockMixin, Glm4DecoderLayer):
    """One GLM-4 layer: attention with q/k/v biases and partial rotary, a norm after attention
    and after the MLP as well as before them, then a fused gate/up MLP."""

    rotary_class = Glm4RotaryEmbedding


class Glm4MoeBlock(RotaryBlockMixin, Glm4MoeDecoderLayer):
    """One GLM-4.5/4.6 layer: attention (optionally with q/k norms), then a dense MLP (the first
    ``first_k_dense_replace`` layers) or shared and routed experts (group-limited routing)."""

    rotary_class = Glm4MoeRotaryEmbedding


class GlmMoeDsaBlock(RotaryBlockMixin, GlmMoeDsaDecoderLayer):
    """One GLM-5 layer: latent attention over the tokens its indexer picks (DeepSeek Sparse Attention),
    then a dense MLP (the first ``first_k_dense_replace`` layers) or shared and routed experts.

    The attention is transformers' own: it expands the cached latent into per-head keys and values at
    every step (exact; petals-deepseek's absorbed form would be faster for long contexts)."""

    rotary_class = GlmMoeDsaRotaryEmbedding

    def causal_mask(
        self, hidden_states: torch.Tensor, cache: PagedCache | None, position_ids: torch.LongTensor, **kwargs
    ) -> torch.Tensor:
        """Always a mask, as the full model builds it: the indexer masks its scores with it."""
        return super().causal_mask(hidden_states, cache, position_ids, allow_is_causal_skip=False, **kwargs)

    def forward(self, hidden_states: torch.Tensor, cache: PagedCache | None = None) -> torch.Tensor:
        return super().forward(hidden_states, cache)[0]  # without the top-k: no later layer reuses it
