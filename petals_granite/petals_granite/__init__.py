"""Granite family plugin for petals-core."""

from petals_granite.config import (
    DistributedGraniteConfig,
    DistributedGraniteMoeConfig,
)

__all__ = [
    "DistributedGraniteConfig",
    "DistributedGraniteMoeConfig",
]
