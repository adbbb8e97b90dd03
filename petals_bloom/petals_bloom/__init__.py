"""BLOOM family plugin for petals-core."""

from petals_bloom.config import DistributedBloomConfig

__all__ = ["DistributedBloomConfig"]
