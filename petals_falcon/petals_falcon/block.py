import math

import torch
from transformers.masking_utils import create_recurrent_attention_mask
from transformers.models.falcon.modeling_falcon import (
    FalconDecoderLayer,
    FalconRotaryEmbedding,
    build_alibi_tensor,
)
from transformers.models.falcon_h1.modeling_falcon_h1 import (
    FalconH1DecoderLayer,
    FalconH1RotaryEmbedding,
    compute_mup_vector,
)

from petals.block import ServerBlockMixin
from petals.kv_cache import PagedCache


class FalconBlock(ServerBlockMixin, FalconDecoderLayer):
    """One Falcon layer: rotary positions, or ALiBi folded into the mask as FalconModel does."""

    rotary_class = FalconRotaryEmbedding

    def forward(self, hidden_states: torch.Tensor, cache: PagedCache | None = None) -> torch.Tensor:
        position_ids = self.position_ids(hidden_states, cache)
        mask = self.causal_mask(hidden_states, cache, position_ids, allow_is_causal_skip=False)
        alibi = position_embeddings = None
        if self.config.alibi:
            alibi, mask = self._alibi_and_mask(hidden_states, cache, mask)
        else:
            position_embeddings = self.rotary_embeddings(hidden_states, position_ids, cache)
        return super().forward(
            hidden_states,
            alibi=alibi,  # 5.24's attention takes it; 5.25 and later find ALiBi in the mask alone and drop it
            attention_mask=mask,
            position_ids=position_ids,
            layer_past=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )[0]

    def _alibi_and_mask(
        self, hidden_states: torch.Tensor, cache: PagedCache | None, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = hidden_states.shape[0]
        keys = self.attention_mask(hidden_states, cache)  # a merged cache's padding gets no ALiBi position
        alibi = build_alibi_tensor(keys, self.config.num_attention_heads, dtype=hidden_states.dtype)
        min_dtype = torch.finfo(hidden_states.dtype).min
        if mask.dtype == torch.bool:
            mask = torch.where(
                mask, torch.zeros((), dtype=hidden_states.dtype, device=mask.device), min_dtype
            )
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        biased = alibi.reshape(batch_size, -1, *alibi.shape[1:]) / math.sqrt(head_dim)
        return alibi, torch.masked_fill(biased, mask < -1, min_dtype)


class FalconH1Block(ServerBlockMixin, FalconH1DecoderLayer):
    """One Falcon-H1 layer: a Mamba2 mixer and rotary attention side by side on the same input, then an
    MLP. Its cache is both (``HybridSpec``): the mixer's state and the attention's keys and values."""

    rotary_class = FalconH1RotaryEmbedding

    def __init__(self, config, block_index: int = 0) -> None:
        super().__init__(config, block_index)
        # FalconH1Model gives each mixer its muP multipliers as a buffer not saved in checkpoints
        with torch.device("cpu"):
            self.mamba.register_buffer("mup_vector", compute_mup_vector(self.config), persistent=False)

    def forward(self, hidden_states: torch.Tensor, cache: PagedCache | None = None) -> torch.Tensor:
        position_ids = self.position_ids(hidden_states, cache)
        return super().forward(
            hidden_states,
            attention_mask=self.causal_mask(hidden_states, cache, position_ids),
            mamba_attention_mask=create_recurrent_attention_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=self.attention_mask(hidden_states, cache) if cache is not None else None,
                cache=cache,
            ),
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary_embeddings(hidden_states, position_ids, cache),
        )[0]
