from transformers import MixtralConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedMixtralConfig(DistributedConfigMixin, MixtralConfig):
    block_class = LazyClass("petals_mixtral.block:MixtralBlock")
    block_prefix = "model.layers"
    default_pad_token_id = 0
