from transformers import MixtralConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedMixtralConfig(DistributedConfigMixin, MixtralConfig):
    block_class = LazyClass("petals_mixtral.block:MixtralBlock")
    attn_class = LazyClass("transformers.models.mixtral.modeling_mixtral:MixtralAttention")
    block_prefix = "model.layers"
    default_pad_token_id = 0
