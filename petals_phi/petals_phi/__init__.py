"""Phi family plugin for petals-core."""

from petals_phi.config import (
    DistributedPhi3Config,
    DistributedPhimoeConfig,
)

__all__ = [
    "DistributedPhi3Config",
    "DistributedPhimoeConfig",
]
