import torch
from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor

from petals.block import ServerBlockMixin
from petals.kv_cache import PagedCache


class BloomServerBlock(ServerBlockMixin, BloomBlock):
    """One BLOOM block; ALiBi biases span the cached plus the new tokens of each row."""

    def forward(self, hidden_states: torch.Tensor, cache: PagedCache | None = None) -> torch.Tensor:
        keys = self.attention_mask(hidden_states, cache)  # a merged cache's padding gets no ALiBi position
        alibi = build_alibi_tensor(keys, self.config.n_head, hidden_states.dtype)
        mask = self.causal_mask(hidden_states, cache, self.position_ids(hidden_states, cache))
        return super().forward(
            hidden_states, alibi=alibi, attention_mask=mask, layer_past=cache, use_cache=cache is not None
        )[0]
