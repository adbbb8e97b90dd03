"""Qwen2 family plugin for petals-core: a third-party-style plugin using only public hooks."""

from petals_qwen2.config import DistributedQwen2Config

__all__ = ["DistributedQwen2Config"]
