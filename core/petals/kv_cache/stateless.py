"""The manager of layers that cache nothing (``StatelessSpec``): a feed-forward or experts layer that
transformers lists among the model's layer types ("mlp", "moe") beside attention and state layers.

Such a layer's output at a position depends on its input at that position alone. Its cache counts the
tokens each sequence has seen, so that it follows rewinds, replays and merged sessions like any other;
it takes no pages and gives none back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from petals.kv_cache.attention import RowsCache, check_hypo_ids
from petals.kv_cache.base import KindCache, Pool
from petals.kv_cache.specs import CacheSpec, StatelessSpec


class EmptyPool(Pool):
    """What a block of a kind that keeps nothing per token or sequence takes from the server's budget:
    nothing (no arena, no ``parts``)."""

    def __init__(self, spec: CacheSpec, *args, **kwargs) -> None:
        super().__init__(spec, None, page_tokens=0)

    @classmethod
    def page_demand(
        cls, spec: CacheSpec, dtype: torch.dtype, page_tokens: int
    ) -> tuple[tuple[int, int], ...]:
        return ()

    @classmethod
    def for_budget(cls, spec: CacheSpec, *args) -> EmptyPool:
        return cls(spec)

    for_session = for_budget

    @property
    def parts(self) -> tuple[Pool, ...]:
        return ()

    def pages_for(self, tokens: int) -> int:
        return 0

    def max_pages(self, length: int) -> int:
        return 0


class StatelessCache(KindCache):
    """One session's cache of a block that keeps nothing: its length alone."""

    pool_class = EmptyPool
    spec: StatelessSpec
    serves = (StatelessSpec,)

    @classmethod
    def make_pool(cls, spec: StatelessSpec, *args, **where) -> EmptyPool:
        return EmptyPool(spec)

    @classmethod
    def merged(cls, caches: Sequence[StatelessCache]) -> StatelessRowsCache:
        return StatelessRowsCache(caches)

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        check_hypo_ids(hypo_ids, self.num_sequences)  # nothing to move


class CountingLayer:
    """The cache layer transformers' code may ask for sizes: every token seen, none dropped."""

    is_compileable = False
    is_initialized = True
    is_sliding = False

    def __init__(self, members: Sequence[StatelessCache]) -> None:
        self.members = list(members)

    def get_seq_length(self) -> int:
        return max(member.length for member in self.members)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class StatelessRowsCache(RowsCache):
    """Several sessions' caches of a block that keeps nothing, for one batched forward (``layer``: what
    transformers' mask functions read; by default every token seen, none dropped)."""

    def __init__(self, members: Sequence[KindCache], layer=None) -> None:
        super().__init__(members, layer if layer is not None else CountingLayer(members))

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def update(self, key_states, value_states, layer_idx: int = 0, *args, **kwargs):
        raise ValueError(f"block {self.layer_index} keeps no keys or values: its layer has no attention")

    def finish_step(self, new_tokens: int) -> None:
        """The block's forward returned (``ServerBlockMixin`` calls this): the rows moved on."""
        for member in self.members:
            member.advance(new_tokens)
