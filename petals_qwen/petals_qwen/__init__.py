"""Qwen family plugin for petals-core (Qwen2 itself is the example plugin ``plugins/petals_qwen2``)."""

from petals_qwen.config import (
    DistributedQwen2MoeConfig,
    DistributedQwen3_5MoeTextConfig,
    DistributedQwen3_5TextConfig,
    DistributedQwen3Config,
    DistributedQwen3MoeConfig,
    DistributedQwen3NextConfig,
)

__all__ = [
    "DistributedQwen2MoeConfig",
    "DistributedQwen3_5MoeTextConfig",
    "DistributedQwen3_5TextConfig",
    "DistributedQwen3Config",
    "DistributedQwen3MoeConfig",
    "DistributedQwen3NextConfig",
]
