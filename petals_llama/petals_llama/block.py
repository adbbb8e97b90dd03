import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from petals.block import ServerBlockMixin
from petals.kv_cache import BlockCache


class LlamaBlock(ServerBlockMixin, LlamaDecoderLayer):
    """One Llama decoder layer with its rotary embedding (llama3 rope scaling included)."""

    rotary_class = LlamaRotaryEmbedding

    def __init__(self, config) -> None:
        config = self.prepare_config(config)
        super().__init__(config, layer_idx=0)
        self.config = config
        with torch.device("cpu"):  # inv_freq is computed, not loaded: never leave it on "meta"
            self.rotary_emb = self.rotary_class(config)

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
