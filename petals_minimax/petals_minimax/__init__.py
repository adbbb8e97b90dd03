"""MiniMax family plugin for petals-core: MiniMax-M2 (``minimax_m2``)."""

from petals_minimax.config import DistributedMiniMaxM2Config

__all__ = ["DistributedMiniMaxM2Config"]
