from transformers import BloomConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedBloomConfig(DistributedConfigMixin, BloomConfig):
    block_class = LazyClass("petals_bloom.block:BloomServerBlock")
    attn_class = LazyClass("transformers.models.bloom.modeling_bloom:BloomAttention")
    block_prefix = "transformer.h"  # bigscience repos store "h.N."; the loader accepts both
    block_output_is_tuple = True
