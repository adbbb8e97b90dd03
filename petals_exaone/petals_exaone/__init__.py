"""EXAONE family plugin for petals-core: EXAONE 4.0 (``exaone4``)."""

from petals_exaone.config import DistributedExaone4Config

__all__ = ["DistributedExaone4Config"]
