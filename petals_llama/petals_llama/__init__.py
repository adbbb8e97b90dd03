"""Llama family plugin for petals-core."""

from petals_llama.config import DistributedLlamaConfig

__all__ = ["DistributedLlamaConfig"]
