import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from petals.block import ServerBlockMixin
from petals.kv_cache import BlockCache


class LlamaBlock(ServerBlockMixin, LlamaDecoderLayer):
    """One Llama decoder layer with its rotary embedding (llama3 rope scaling included)."""

    rotary_class = LlamaRotaryEmbedding

    def forward(self, hidden_states: torch.Tensor, cache: BlockCache | None = None) -> torch.Tensor:
        position_ids = self.position_ids(hidden_states, cache)
        return super().forward(
            hidden_states,
            attention_mask=self.causal_mask(hidden_states, cache, position_ids),
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary_emb(hidden_states, position_ids),
        )
