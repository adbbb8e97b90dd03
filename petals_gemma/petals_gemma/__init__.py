"""Gemma family plugin for petals-core: Gemma, Gemma 2 and Gemma 3 (text)."""

from petals_gemma.config import DistributedGemma2Config, DistributedGemma3TextConfig, DistributedGemmaConfig

__all__ = ["DistributedGemma2Config", "DistributedGemma3TextConfig", "DistributedGemmaConfig"]
