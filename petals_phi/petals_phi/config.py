from transformers import Phi3Config, PhimoeConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedPhi3Config(DistributedConfigMixin, Phi3Config):
    block_class = LazyClass("petals_phi.block:Phi3Block")
    attn_class = LazyClass("transformers.models.phi3.modeling_phi3:Phi3Attention")
    block_prefix = "model.layers"


class DistributedPhimoeConfig(DistributedConfigMixin, PhimoeConfig):
    block_class = LazyClass("petals_phi.block:PhimoeBlock")
    attn_class = LazyClass("transformers.models.phimoe.modeling_phimoe:PhimoeAttention")
    block_prefix = "model.layers"
