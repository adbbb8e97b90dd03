"""Falcon family plugin for petals-core."""

from petals_falcon.config import DistributedFalconConfig

__all__ = ["DistributedFalconConfig"]
