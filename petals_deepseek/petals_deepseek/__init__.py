"""DeepSeek family plugin for petals-core."""

from petals_deepseek.config import DistributedDeepseekV2Config, DistributedDeepseekV3Config

__all__ = ["DistributedDeepseekV2Config", "DistributedDeepseekV3Config"]
