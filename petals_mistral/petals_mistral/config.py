from transformers import Ministral3Config, MistralConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedMistralConfig(DistributedConfigMixin, MistralConfig):
    block_class = LazyClass("petals_mistral.block:MistralBlock")
    attn_class = LazyClass("transformers.models.mistral.modeling_mistral:MistralAttention")
    block_prefix = "model.layers"


class DistributedMinistral3Config(DistributedConfigMixin, Ministral3Config):
    block_class = LazyClass("petals_mistral.block:Ministral3Block")
    attn_class = LazyClass("transformers.models.ministral3.modeling_ministral3:Ministral3Attention")
    block_prefix = "model.layers"
