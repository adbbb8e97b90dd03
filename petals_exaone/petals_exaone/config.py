from transformers import Exaone4Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedExaone4Config(DistributedConfigMixin, Exaone4Config):
    block_class = LazyClass("petals_exaone.block:Exaone4Block")
    attn_class = LazyClass("transformers.models.exaone4.modeling_exaone4:Exaone4Attention")
    block_prefix = "model.layers"
