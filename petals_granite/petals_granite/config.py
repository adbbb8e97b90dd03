from transformers import GraniteConfig, GraniteMoeConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedGraniteConfig(DistributedConfigMixin, GraniteConfig):
    block_class = LazyClass("petals_granite.block:GraniteBlock")
    attn_class = LazyClass("transformers.models.granite.modeling_granite:GraniteAttention")
    block_prefix = "model.layers"


class DistributedGraniteMoeConfig(DistributedConfigMixin, GraniteMoeConfig):
    block_class = LazyClass("petals_granite.block:GraniteMoeBlock")
    attn_class = LazyClass("transformers.models.granitemoe.modeling_granitemoe:GraniteMoeAttention")
    block_prefix = "model.layers"
