"""Liquid LFM family plugin for petals-core."""

from petals_lfm.config import DistributedLfm2Config

__all__ = ["DistributedLfm2Config"]
