import torch
from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor

from petals.block import ServerBlockMixin
from petals.kv_cache import BlockCache


class BloomServerBlock(ServerBlockMixin, BloomBlock):
    """One BLOOM block; ALiBi biases span the cached plus the new tokens."""

    attn_implementation = "eager"  # what transformers picks for BLOOM

    def forward(self, hidden_states: torch.Tensor, cache: BlockCache | None = None) -> torch.Tensor:
        batch_size, length, _ = hidden_states.shape
        kv_length = cache.get_mask_sizes(length, 0)[0] if cache is not None else length
        ones = torch.ones(batch_size, kv_length, device=hidden_states.device)
        alibi = build_alibi_tensor(ones, self.config.n_head, hidden_states.dtype)
        mask = self.causal_mask(hidden_states, cache, self.position_ids(hidden_states, cache))
        return super().forward(
            hidden_states, alibi=alibi, attention_mask=mask, layer_past=cache, use_cache=cache is not None
        )[0]
