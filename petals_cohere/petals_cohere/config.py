from transformers import Cohere2Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedCohere2Config(DistributedConfigMixin, Cohere2Config):
    block_class = LazyClass("petals_cohere.block:Cohere2Block")
    attn_class = LazyClass("transformers.models.cohere2.modeling_cohere2:Cohere2Attention")
    block_prefix = "model.layers"
