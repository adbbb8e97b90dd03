from transformers import FalconConfig, FalconH1Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedFalconConfig(DistributedConfigMixin, FalconConfig):
    block_class = LazyClass("petals_falcon.block:FalconBlock")
    attn_class = LazyClass("transformers.models.falcon.modeling_falcon:FalconAttention")
    block_prefix = "transformer.h"
    block_output_is_tuple = True
    default_pad_token_id = 0

    @property
    def num_key_value_groups(self) -> int:
        """Falcon's three layouts: grouped (40B/180B), multi-query (7B) and plain multi-head (RW)."""
        if self.new_decoder_architecture:
            return self.num_attention_heads // self.num_kv_heads
        if self.multi_query:
            return self.num_attention_heads
        return 1


class DistributedFalconH1Config(DistributedConfigMixin, FalconH1Config):
    """Falcon-H1: every layer runs a Mamba2 mixer beside attention (transformers' ``hybrid`` layers)."""

    block_class = LazyClass("petals_falcon.block:FalconH1Block")
    attn_class = LazyClass("transformers.models.falcon_h1.modeling_falcon_h1:FalconH1Attention")
    block_prefix = "model.layers"
    block_output_is_tuple = True
