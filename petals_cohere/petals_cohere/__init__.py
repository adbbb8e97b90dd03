"""Cohere family plugin for petals-core: Command R7B and Command A (``cohere2``)."""

from petals_cohere.config import DistributedCohere2Config

__all__ = ["DistributedCohere2Config"]
