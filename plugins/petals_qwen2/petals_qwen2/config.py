from transformers import Qwen2Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedQwen2Config(DistributedConfigMixin, Qwen2Config):
    block_class = LazyClass("petals_qwen2.block:Qwen2Block")
    block_prefix = "model.layers"
