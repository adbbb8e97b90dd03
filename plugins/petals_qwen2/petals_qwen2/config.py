from transformers import Qwen2Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedQwen2Config(DistributedConfigMixin, Qwen2Config):
    block_class = LazyClass("petals_qwen2.block:Qwen2Block")
    attn_class = LazyClass("transformers.models.qwen2.modeling_qwen2:Qwen2Attention")
    block_prefix = "model.layers"
