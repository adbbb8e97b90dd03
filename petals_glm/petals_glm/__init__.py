"""GLM family plugin for petals-core."""

from petals_glm.config import (
    DistributedGlm4Config,
    DistributedGlm4MoeConfig,
    DistributedGlmMoeDsaConfig,
)

__all__ = [
    "DistributedGlm4Config",
    "DistributedGlm4MoeConfig",
    "DistributedGlmMoeDsaConfig",
]
