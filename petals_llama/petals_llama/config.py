from transformers import LlamaConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedLlamaConfig(DistributedConfigMixin, LlamaConfig):
    block_class = LazyClass("petals_llama.block:LlamaBlock")
    attn_class = LazyClass("transformers.models.llama.modeling_llama:LlamaAttention")
    block_prefix = "model.layers"
