"""Mixtral family plugin for petals-core."""

from petals_mixtral.config import DistributedMixtralConfig

__all__ = ["DistributedMixtralConfig"]
