import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

from petals.block import ServerBlockMixin
from petals.kv_cache import BlockCache


class MixtralBlock(ServerBlockMixin, MixtralDecoderLayer):
    """One Mixtral layer: GQA attention (sliding window if configured) and the routed experts."""

    experts_implementation = "grouped_mm"  # what transformers picks for the full model
    rotary_class = MixtralRotaryEmbedding

    def forward(self, hidden_states: torch.Tensor, cache: BlockCache | None = None) -> torch.Tensor:
        position_ids = self.position_ids(hidden_states, cache)
        sliding = self.config.sliding_window is not None
        mask_function = create_sliding_window_causal_mask if sliding else create_causal_mask
        return super().forward(
            hidden_states,
            position_embeddings=self.rotary_emb(hidden_states, position_ids),
            attention_mask=self.causal_mask(hidden_states, cache, position_ids, mask_function),
            position_ids=position_ids,
            cache=cache,
        )
