from transformers import Glm4Config, Glm4MoeConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedGlm4Config(DistributedConfigMixin, Glm4Config):
    block_class = LazyClass("petals_glm.block:Glm4Block")
    attn_class = LazyClass("transformers.models.glm4.modeling_glm4:Glm4Attention")
    block_prefix = "model.layers"


class DistributedGlm4MoeConfig(DistributedConfigMixin, Glm4MoeConfig):
    block_class = LazyClass("petals_glm.block:Glm4MoeBlock")
    attn_class = LazyClass("transformers.models.glm4_moe.modeling_glm4_moe:Glm4MoeAttention")
    block_prefix = "model.layers"
