"""Mistral family plugin for petals-core: Mistral and Ministral 3 (text)."""

from petals_mistral.config import DistributedMinistral3Config, DistributedMistralConfig

__all__ = ["DistributedMinistral3Config", "DistributedMistralConfig"]
