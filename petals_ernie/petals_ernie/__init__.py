"""ERNIE family plugin for petals-core: ERNIE 4.5 MoE (``ernie4_5_moe``)."""

from petals_ernie.config import DistributedErnie4_5_MoeConfig

__all__ = ["DistributedErnie4_5_MoeConfig"]
