"""GPT-OSS family plugin for petals-core."""

from petals_gpt_oss.config import DistributedGptOssConfig

__all__ = ["DistributedGptOssConfig"]
