"""dots family plugin for petals-core: rednote's dots.llm1 (``dots1``)."""

from petals_dots.config import DistributedDots1Config

__all__ = ["DistributedDots1Config"]
