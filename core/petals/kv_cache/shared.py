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

from petals.kv_cache.attention import RowsCache, check_hypo_ids
from petals.kv_cache.pages import CacheOverflowError
from petals.kv_cache.specs import SharedKVSpec, SlidingWindowSpec


class SharedKVPool:
    """What a block of this kind takes from the server's budget: nothing (``parts`` is empty)."""

    parts = ()
    nbytes = 0

    def __init__(self, spec: SharedKVSpec) -> None:
        self.spec = spec


class SharedKVCache:
    """One session's cache of a block that reuses its source's keys and values: its length alone."""

    def __init__(
        self,
        spec: SharedKVSpec,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        layer_index: int = 0,
    ) -> None:
        self.spec, self.layer_index = spec, layer_index
        self.num_sequences, self.max_length = batch_size, max_length
        self.length = 0

    @classmethod
    def paged(
        cls, pool: SharedKVPool, batch_size: int, max_length: int, layer_index: int = 0
    ) -> SharedKVCache:
        return cls(pool.spec, batch_size, max_length, layer_index=layer_index)

    @classmethod
    def make_pool(
        cls,
        spec: SharedKVSpec,
        tokens: int,
        page_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        **where,
    ) -> SharedKVPool:
        return SharedKVPool(spec)

    @staticmethod
    def page_demand(spec: SharedKVSpec, dtype: torch.dtype, page_tokens: int) -> tuple[tuple[int, int], ...]:
        return ()

    @staticmethod
    def merged(caches: Sequence[SharedKVCache]) -> SharedRowsCache:
        return SharedRowsCache(caches)

    def view(self) -> SharedRowsCache:
        return self.merged([self])

    @property
    def position(self) -> int:
        return self.length

    nbytes = 0

    def visible_offset(self, length: int) -> int:
        """The first position the source's keys cover after ``length`` cached tokens (its window's)."""
        attention = self.spec.attention
        return max(0, length - (attention.window - 1)) if isinstance(attention, SlidingWindowSpec) else 0

    def reserve(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_length:
            raise CacheOverflowError(
                f"Maximum length exceeded: {self.length} cached + {new_tokens} new tokens "
                f"> max_length {self.max_length}"
            )

    def rewind(self, position: int) -> None:
        if not 0 <= position <= self.length:
            raise ValueError(f"cannot rewind to position {position}: {self.length} tokens are cached")
        self.length = position

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        check_hypo_ids(hypo_ids, self.num_sequences)  # the source's cache reorders the keys themselves

    def release(self) -> None:
        self.length = 0


class SharedKVLayer:
    """The cache layer a reusing block's mask functions read: its source's sizes, before the step."""

    is_compileable = False
    is_initialized = True

    def __init__(self, members: Sequence[SharedKVCache]) -> None:
        self.members = list(members)
        self.is_sliding = isinstance(self.members[0].spec.attention, SlidingWindowSpec)

    def get_seq_length(self) -> int:
        return max(member.length for member in self.members)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        length = self.get_seq_length()
        offset = self.members[0].visible_offset(length)
        return length + query_length - offset, offset


class SharedRowsCache(RowsCache):
    """Several sessions' reusing caches of one block, for one batched forward."""

    def __init__(self, members: Sequence[SharedKVCache]) -> None:
        super().__init__(members, SharedKVLayer(members))

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def update(self, key_states, value_states, layer_idx: int = 0, *args, **kwargs):
        raise ValueError(
            f"block {self.layer_index} reuses the keys and values of block {self.members[0].spec.source}: "
            "it has none of its own to cache"
        )

    def finish_step(self, new_tokens: int) -> None:
        """The block's forward returned (``ServerBlockMixin`` calls this): the rows moved on."""
        for member in self.members:
            member.length += new_tokens
