"""Llama family plugin for petals-core: Llama 1-3.x, Llama 4 (text) and SmolLM3."""

from petals_llama.config import DistributedLlama4TextConfig, DistributedLlamaConfig, DistributedSmolLM3Config

__all__ = ["DistributedLlama4TextConfig", "DistributedLlamaConfig", "DistributedSmolLM3Config"]
