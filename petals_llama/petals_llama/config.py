from transformers import LlamaConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedLlamaConfig(DistributedConfigMixin, LlamaConfig):
    block_class = LazyClass("petals_llama.block:LlamaBlock")
    block_prefix = "model.layers"
