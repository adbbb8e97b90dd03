from transformers import Olmo2Config, Olmo3Config, OlmoeConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedOlmo2Config(DistributedConfigMixin, Olmo2Config):
    block_class = LazyClass("petals_olmo.block:Olmo2Block")
    attn_class = LazyClass("transformers.models.olmo2.modeling_olmo2:Olmo2Attention")
    block_prefix = "model.layers"


class DistributedOlmo3Config(DistributedConfigMixin, Olmo3Config):
    block_class = LazyClass("petals_olmo.block:Olmo3Block")
    attn_class = LazyClass("transformers.models.olmo3.modeling_olmo3:Olmo3Attention")
    block_prefix = "model.layers"


class DistributedOlmoeConfig(DistributedConfigMixin, OlmoeConfig):
    block_class = LazyClass("petals_olmo.block:OlmoeBlock")
    attn_class = LazyClass("transformers.models.olmoe.modeling_olmoe:OlmoeAttention")
    block_prefix = "model.layers"
