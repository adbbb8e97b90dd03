"""OLMo family plugin for petals-core."""

from petals_olmo.config import (
    DistributedOlmo2Config,
    DistributedOlmo3Config,
    DistributedOlmoeConfig,
)

__all__ = [
    "DistributedOlmo2Config",
    "DistributedOlmo3Config",
    "DistributedOlmoeConfig",
]
