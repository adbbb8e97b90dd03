from transformers import Ernie4_5_MoeConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedErnie4_5_MoeConfig(DistributedConfigMixin, Ernie4_5_MoeConfig):
    block_class = LazyClass("petals_ernie.block:Ernie4_5_MoeBlock")
    attn_class = LazyClass("transformers.models.ernie4_5_moe.modeling_ernie4_5_moe:Ernie4_5_MoeAttention")
    block_prefix = "model.layers"
