"""Gemma family plugin for petals-core: Gemma, Gemma 2, Gemma 3 (text) and Gemma 4 (text)."""

from petals_gemma.config import (
    DistributedGemma2Config,
    DistributedGemma3TextConfig,
    DistributedGemma4TextConfig,
    DistributedGemmaConfig,
)

__all__ = [
    "DistributedGemma2Config",
    "DistributedGemma3TextConfig",
    "DistributedGemma4TextConfig",
    "DistributedGemmaConfig",
]
