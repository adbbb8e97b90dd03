"""The manager of layers that reuse an earlier layer's keys and values (``SharedKVSpec``): no memory.

Such a layer (Gemma 4's last ``num_kv_shared_layers``) attends with what its source layer's cache
returned in the same forward, which the blocks of one pass hand on in a dict (``shared_kv_states``,
as transformers' model does). Its cache only counts the tokens each sequence has seen, so that the
block's positions and mask are its source's: the same rows, lengths and visible window as the source
had before the step. It takes no pages, gives none back, and follows rewinds like any cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from petals.kv_cache.attention import check_hypo_ids
from petals.kv_cache.base import KindCache
from petals.kv_cache.specs import SharedKVSpec, SlidingWindowSpec
from petals.kv_cache.stateless import CountingLayer, EmptyPool, StatelessRowsCache


class SharedKVPool(EmptyPool):
    """What a block of this kind takes from the server's budget: nothing."""

    spec: SharedKVSpec


class SharedKVCache(KindCache):
    """One session's cache of a block that reuses its source's keys and values: its length alone."""

    pool_class = SharedKVPool
    spec: SharedKVSpec
    serves = (SharedKVSpec,)

    @classmethod
    def make_pool(cls, spec: SharedKVSpec, *args, **where) -> SharedKVPool:
        return SharedKVPool(spec)

    @classmethod
    def merged(cls, caches: Sequence[SharedKVCache]) -> SharedRowsCache:
        return SharedRowsCache(caches)

    def visible_offset(self, length: int) -> int:
        """The first position the source's keys cover after ``length`` cached tokens (its window's)."""
        attention = self.spec.attention
        return max(0, length - (attention.window - 1)) if isinstance(attention, SlidingWindowSpec) else 0

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        check_hypo_ids(hypo_ids, self.num_sequences)  # the source's cache reorders the keys themselves


class SharedKVLayer(CountingLayer):
    """The cache layer a reusing block's mask functions read: its source's sizes, before the step."""

    def __init__(self, members: Sequence[SharedKVCache]) -> None:
        super().__init__(members)
        self.is_sliding = isinstance(self.members[0].spec.attention, SlidingWindowSpec)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        length = self.get_seq_length()
        offset = self.members[0].visible_offset(length)
        return length + query_length - offset, offset


class SharedRowsCache(StatelessRowsCache):
    """Several sessions' reusing caches of one block, for one batched forward."""

    def __init__(self, members: Sequence[SharedKVCache]) -> None:
        super().__init__(members, SharedKVLayer(members))

    def update(self, key_states, value_states, layer_idx: int = 0, *args, **kwargs):
        raise ValueError(
            f"block {self.layer_index} reuses the keys and values of block {self.members[0].spec.source}: "
            "it has none of its own to cache"
        )
