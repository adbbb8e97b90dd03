from transformers import Dots1Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedDots1Config(DistributedConfigMixin, Dots1Config):
    block_class = LazyClass("petals_dots.block:Dots1Block")
    attn_class = LazyClass("transformers.models.dots1.modeling_dots1:Dots1Attention")
    block_prefix = "model.layers"
