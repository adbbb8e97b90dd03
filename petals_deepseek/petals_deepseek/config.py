from transformers import DeepseekV2Config, DeepseekV3Config, KimiLinearConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedDeepseekV3Config(DistributedConfigMixin, DeepseekV3Config):
    """DeepSeek V3, V3.1 and R1, and Kimi K2, which ships as this model type."""

    block_class = LazyClass("petals_deepseek.block:DeepseekV3Block")
    attn_class = LazyClass("transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3Attention")
    block_prefix = "model.layers"


class DistributedDeepseekV2Config(DistributedConfigMixin, DeepseekV2Config):
    block_class = LazyClass("petals_deepseek.block:DeepseekV2Block")
    attn_class = LazyClass("transformers.models.deepseek_v2.modeling_deepseek_v2:DeepseekV2Attention")
    block_prefix = "model.layers"


class DistributedKimiLinearConfig(DistributedConfigMixin, KimiLinearConfig):
    """Kimi Linear: Kimi Delta Attention layers (a fixed-size state per sequence) between DeepSeek-style
    latent attention layers (without rotary positions)."""

    block_class = LazyClass("petals_deepseek.block:KimiLinearBlock")
    attn_class = LazyClass("transformers.models.kimi_linear.modeling_kimi_linear:KimiLinearAttention")
    block_prefix = "model.layers"
