from transformers import (
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from petals.config import DistributedConfigMixin, LazyClass


class DistributedQwen3Config(DistributedConfigMixin, Qwen3Config):
    block_class = LazyClass("petals_qwen.block:Qwen3Block")
    attn_class = LazyClass("transformers.models.qwen3.modeling_qwen3:Qwen3Attention")
    block_prefix = "model.layers"


class DistributedQwen3MoeConfig(DistributedConfigMixin, Qwen3MoeConfig):
    block_class = LazyClass("petals_qwen.block:Qwen3MoeBlock")
    attn_class = LazyClass("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeAttention")
    block_prefix = "model.layers"


class DistributedQwen3NextConfig(DistributedConfigMixin, Qwen3NextConfig):
    """Qwen3-Next: gated delta net (linear attention) layers between full-attention ones; core's
    default ``cache_spec`` gives the former a fixed-size state per sequence."""

    block_class = LazyClass("petals_qwen.block:Qwen3NextBlock")
    attn_class = LazyClass("transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextAttention")
    block_prefix = "model.layers"


class DistributedQwen3_5TextConfig(DistributedConfigMixin, Qwen3_5TextConfig):
    """Qwen3.5's language model: Qwen3-Next's mix of gated delta net and full-attention layers, with
    a dense MLP."""

    block_class = LazyClass("petals_qwen.block:Qwen3_5Block")
    attn_class = LazyClass("transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5Attention")
    block_prefix = "model.layers"


class DistributedQwen3_5MoeTextConfig(DistributedConfigMixin, Qwen3_5MoeTextConfig):
    """Qwen3.5 MoE's language model: Qwen3-Next's layers, routed experts and gated shared expert."""

    block_class = LazyClass("petals_qwen.block:Qwen3_5MoeBlock")
    attn_class = LazyClass("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeAttention")
    block_prefix = "model.layers"


class DistributedQwen2MoeConfig(DistributedConfigMixin, Qwen2MoeConfig):
    block_class = LazyClass("petals_qwen.block:Qwen2MoeBlock")
    attn_class = LazyClass("transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeAttention")
    block_prefix = "model.layers"
