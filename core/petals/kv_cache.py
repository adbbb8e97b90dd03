"""The key/value cache a server keeps for its blocks: fixed-size pages from one pool per block.

A ``PagePool`` holds one block's keys and values as pages of ``page_tokens`` tokens. A session's
``BlockCache`` takes pages from it as its sequences grow (a page table per sequence) and gives
them back when it rewinds or ends, so memory is held for the tokens cached, not for ``max_length``.

Both ``BlockCache`` (one session) and ``PagedCache`` (the rows of several sessions, one forward)
are transformers ``Cache`` objects: Hugging Face decoder layers call ``cache.update(key, value,
layer_idx=0)`` exactly as inside the full model. ``update`` writes the new keys and values into
each sequence's pages and hands the layer every row's keys and values, left-padded to the longest
row; ``position_ids`` and ``attention_mask`` tell the block each row's positions and which key
slots are padding, so rows at different positions share one batched attention.

``BlockCache(layout, batch_size, max_length)`` without a pool is a standalone cache that takes its
whole ``max_length`` up front (tests, throughput measurements); the server opens its sessions'
caches on the block's shared pool with ``BlockCache.paged``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

PAGE_TOKENS = 16  # tokens per page: small enough to waste little, large enough to index cheaply
_UNKNOWN = object()


class CacheOverflowError(ValueError):
    """A step would write past the session's ``max_length``."""


class OutOfPagesError(RuntimeError):
    """The block's page pool has no free page left for a growing session."""


@dataclass(frozen=True)
class KVCacheLayout:
    """What one block caches per token: ``num_kv_heads`` keys and values of ``head_dim`` each.

    ``num_query_heads`` is how many heads the attention computes; when a layer hands the cache
    keys broadcast to all query heads (as some grouped-query layers do), the cache keeps one
    head per group and expands them again on read.
    """

    num_kv_heads: int
    head_dim: int
    num_query_heads: int

    def __post_init__(self) -> None:
        if min(self.num_kv_heads, self.head_dim, self.num_query_heads) <= 0:
            raise ValueError(f"invalid KV cache layout {self}")
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_query_heads} query heads do not split into {self.num_kv_heads} groups"
            )

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of keys plus values that one cached token of one block takes."""
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize


class PagePool:
    """One block's keys and values in ``num_pages`` pages of ``page_tokens`` tokens, shared by sessions.

    Pages are taken and given back under a lock: the compute thread takes them as sessions grow,
    the event loop gives a finished session's pages back.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        num_pages: int,
        page_tokens: int = PAGE_TOKENS,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1 or page_tokens < 1:
            raise ValueError(f"a page pool needs pages and tokens per page, got {num_pages} × {page_tokens}")
        self.layout, self.num_pages, self.page_tokens = layout, num_pages, page_tokens
        shape = (num_pages * page_tokens, layout.num_kv_heads, layout.head_dim)
        # empty, not zeros: only written slots are ever read, and on CPU untouched pages stay unmapped
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.lock = threading.RLock()
        self._free = list(range(num_pages - 1, -1, -1))  # taken from the end: low pages first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return self.free_pages * self.page_tokens

    @property
    def page_nbytes(self) -> int:
        return self.page_tokens * self.layout.bytes_per_token(self.keys.dtype)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def take(self, count: int) -> list[int]:
        with self.lock:
            if count > len(self._free):
                raise OutOfPagesError(
                    f"the server's KV cache is full: {count} more pages of {self.page_tokens} tokens needed, "
                    f"{len(self._free)} free; try again later or another server"
                )
            pages = self._free[len(self._free) - count :]
            del self._free[len(self._free) - count :]
            return pages

    def give_back(self, pages: Sequence[int]) -> None:
        with self.lock:
            self._free.extend(reversed(pages))


class PagedLayer(CacheLayerMixin):
    """The single cache layer of a block, over the sequences of one or more ``BlockCache``s."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, members: Sequence[BlockCache]) -> None:  # no super().__init__: keys are properties
        self.members = list(members)
        self.pool = self.members[0].pool
        if any(member.pool is not self.pool for member in self.members):
            raise ValueError("caches computed in one forward must share one page pool")
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool is allocated up front."""

    @property
    def keys(self) -> torch.Tensor:
        """A copy of the cached keys, ``[rows, kv_heads, length, head_dim]`` (left-padded rows)."""
        return self._read()[0]

    @property
    def values(self) -> torch.Tensor:
        return self._read()[1]

    def get_seq_length(self) -> int:
        return max(member.length for member in self.members)

    def get_max_length(self) -> int:
        return max(member.max_length for member in self.members)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values into each sequence's pages; return every row's whole history,
        left-padded (with zeros) to the longest row."""
        layout = self.pool.layout
        broadcast = key_states.shape[1] != layout.num_kv_heads
        key_states, value_states = _grouped(key_states, layout), _grouped(value_states, layout)
        new_tokens = key_states.shape[-2]
        for member in self.members:
            member.reserve(new_tokens)
        if len(self.members) == 1 and (start := self.members[0].contiguous_start()) is not None:
            self._write_contiguous(start, key_states, value_states)
        else:
            self._write_slots(key_states, value_states)
        for member in self.members:
            member.length += new_tokens
        keys, values = self._read()
        if broadcast:  # hand back as many heads as the layer gave
            keys = keys.repeat_interleave(layout.group_size, dim=1)
            values = values.repeat_interleave(layout.group_size, dim=1)
        return keys, values

    def _write_contiguous(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One sequence in consecutive pages (a lone session's): the step's tokens are one slice."""
        first = start + self.members[0].length
        end = first + key_states.shape[-2]
        self.pool.keys[first:end].copy_(key_states[0].transpose(0, 1))
        self.pool.values[first:end].copy_(value_states[0].transpose(0, 1))

    def _write_slots(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        new_tokens = key_states.shape[-2]
        slots = torch.cat(
            [member.slots(member.length, member.length + new_tokens) for member in self.members]
        )
        self.pool.keys[slots.flatten()] = key_states.transpose(1, 2).flatten(0, 1)
        self.pool.values[slots.flatten()] = value_states.transpose(1, 2).flatten(0, 1)

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.members) == 1 and (start := self.members[0].contiguous_start()) is not None:
            end = start + self.members[0].length  # one sequence in consecutive pages: a view, no copy
            return self.pool.keys[None, start:end].transpose(1, 2), self.pool.values[
                None, start:end
            ].transpose(1, 2)
        length = self.get_seq_length()
        slots = torch.cat([_left_padded(member.slots(0, member.length), length) for member in self.members])
        padding = slots < 0
        slots = slots.clamp(min=0)
        keys = self.pool.keys[slots].masked_fill_(padding[..., None, None], 0)
        values = self.pool.values[slots].masked_fill_(padding[..., None, None], 0)
        return keys.transpose(1, 2), values.transpose(1, 2)


class PagedCache(Cache):
    """Several sessions' caches of one block, for one batched forward (their rows, in order).

    Rows may sit at different positions: keys are left-padded to the longest row, so a block
    builds its masks from ``attention_mask`` and its positions from ``position_ids``.
    """

    def __init__(self, members: Sequence[BlockCache]) -> None:
        super().__init__(layers=[PagedLayer(members)])

    @property
    def layer(self) -> PagedLayer:
        return self.layers[0]

    def _row_lengths(self, device: torch.device | str) -> torch.Tensor:
        lengths = [member.length for member in self.layer.members for _ in range(member.num_sequences)]
        return torch.tensor(lengths, device=device)

    @property
    def rows_aligned(self) -> bool:
        """Whether every row has cached as many tokens (no row is padded)."""
        members = self.layer.members
        return all(member.length == members[0].length for member in members)

    def row_positions(self) -> tuple[tuple[int, int], ...]:
        """``(cached tokens, rows)`` of each member (session), in order: where this step's rows start."""
        return tuple((member.length, member.num_sequences) for member in self.layer.members)

    def position_ids(self, query_length: int, device: torch.device | str = "cpu") -> torch.LongTensor:
        """``[rows, query_length]``: each row's positions of the step's tokens."""
        if self.rows_aligned:  # the common case, one session: no per-row tensor to build
            start = self.layer.members[0].length
            rows = sum(member.num_sequences for member in self.layer.members)
            return torch.arange(start, start + query_length, device=device).expand(rows, query_length)
        return self._row_lengths(device)[:, None] + torch.arange(query_length, device=device)

    def attention_mask(self, query_length: int, device: torch.device | str = "cpu") -> torch.LongTensor:
        """``[rows, cached + query_length]`` (the longest row's): 1 for a key of the row, 0 for padding."""
        lengths = self._row_lengths(device)
        slots = torch.arange(self.layer.get_seq_length() + query_length, device=device)
        return (slots >= self.layer.get_seq_length() - lengths[:, None]).long()


class BlockCache(PagedCache):
    """The cache of one block in one session: page tables over a pool, rewindable, reorderable for beams."""

    def __init__(
        self,
        layout: KVCacheLayout,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        pool: PagePool | None = None,
    ) -> None:
        standalone = pool is None
        if pool is None:  # a pool of its own, one page per sequence: the whole max_length up front
            pool = PagePool(layout, max(batch_size, 1), max(max_length, 1), dtype, device)
        self.pool, self.layout = pool, layout
        self.num_sequences, self.max_length = batch_size, max_length
        self.length = 0
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self._table_tensor: torch.Tensor | None = None
        self._contiguous: int | None | object = _UNKNOWN  # contiguous_start(), once computed
        self._released = False
        super().__init__([self])
        if standalone:
            self.reserve(max_length)

    @classmethod
    def paged(cls, pool: PagePool, batch_size: int, max_length: int) -> BlockCache:
        """A session's cache on a block's shared pool: it takes pages as it grows."""
        return cls(pool.layout, batch_size, max_length, pool=pool)

    @staticmethod
    def merged(caches: Sequence[BlockCache]) -> PagedCache:
        """One cache over all rows of ``caches`` (sessions on the same block), for one forward."""
        return caches[0] if len(caches) == 1 else PagedCache(caches)

    @property
    def position(self) -> int:
        """How many tokens are cached."""
        return self.length

    @property
    def pages_held(self) -> int:
        return sum(len(table) for table in self.tables)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages this cache holds."""
        return self.pages_held * self.pool.page_nbytes

    def reserve(self, new_tokens: int) -> None:
        """Take the pages that ``new_tokens`` more tokens need (raises, taking none, if it cannot)."""
        end = self.length + new_tokens
        if end > self.max_length:
            raise CacheOverflowError(
                f"Maximum length exceeded: {self.length} cached + {new_tokens} new tokens "
                f"> max_length {self.max_length}"
            )
        missing = self.pool.pages_for(end) - len(self.tables[0]) if self.tables else 0
        if missing <= 0:
            return
        with self.pool.lock:
            if self._released:
                raise RuntimeError("this session's cache was released: the session has ended")
            pages = self.pool.take(missing * self.num_sequences)
            for row, table in enumerate(self.tables):
                table.extend(pages[row * missing : (row + 1) * missing])
        self._table_tensor, self._contiguous = None, _UNKNOWN

    def slots(self, start: int, end: int) -> torch.LongTensor:
        """``[sequences, end - start]``: where positions ``start..end-1`` of each sequence live in the pool."""
        if self._table_tensor is None:
            tables = torch.tensor(self.tables, dtype=torch.long, device=self.pool.keys.device)
            offsets = torch.arange(self.pool.page_tokens, device=tables.device)
            self._table_tensor = (tables[:, :, None] * self.pool.page_tokens + offsets).flatten(1)
        return self._table_tensor[:, start:end]

    def contiguous_start(self) -> int | None:
        """The first slot of a single sequence whose pages lie one after another (as a lone session's do)."""
        if self._contiguous is _UNKNOWN:
            self._contiguous = self._find_contiguous_start()
        return self._contiguous

    def _find_contiguous_start(self) -> int | None:
        if self.num_sequences != 1 or not self.tables[0]:
            return None
        table = self.tables[0]
        if table[-1] - table[0] != len(table) - 1 or any(b - a != 1 for a, b in itertools.pairwise(table)):
            return None
        return table[0] * self.pool.page_tokens

    def rewind(self, position: int) -> None:
        """Forget every token from ``position`` on (the next step writes there); give back unused pages."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to position {position}: {self.position} tokens are cached")
        self.length = position
        keep = self.pool.pages_for(position)
        with self.pool.lock:
            for table in self.tables:
                self.pool.give_back(table[keep:])
                del table[keep:]
        self._table_tensor, self._contiguous = None, _UNKNOWN

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Reorder the batch (beam search): row ``i`` becomes old row ``hypo_ids[i]``."""
        check_hypo_ids(hypo_ids, self.num_sequences)
        slots = self.slots(0, self.length)
        sources = slots[hypo_ids.to(slots.device)].flatten()
        self.pool.keys[slots.flatten()] = self.pool.keys[sources]
        self.pool.values[slots.flatten()] = self.pool.values[sources]

    def release(self) -> None:
        """Give every page back to the pool; the cache takes no more (the session has ended)."""
        with self.pool.lock:
            self._released = True
            for table in self.tables:
                self.pool.give_back(table)
                table.clear()
        self.length = 0
        self._table_tensor, self._contiguous = None, _UNKNOWN


def check_hypo_ids(hypo_ids: torch.Tensor, num_sequences: int) -> None:
    """``ValueError`` unless ``hypo_ids`` has shape ``[num_sequences]`` and picks rows of the batch."""
    if hypo_ids.shape != (num_sequences,):
        raise ValueError(f"hypo_ids must have shape ({num_sequences},), got {tuple(hypo_ids.shape)}")
    if hypo_ids.numel() and not (0 <= int(hypo_ids.min()) and int(hypo_ids.max()) < num_sequences):
        raise ValueError(f"hypo_ids must be in [0, {num_sequences}), got {hypo_ids.tolist()}")


def _grouped(states: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    if states.shape[1] == layout.num_kv_heads:
        return states
    if states.shape[1] != layout.num_query_heads:
        raise ValueError(
            f"the layer produced {states.shape[1]} key/value heads; the cache layout expects "
            f"{layout.num_kv_heads} (or {layout.num_query_heads} broadcast ones)"
        )
    return states[:, :: layout.group_size]


def _left_padded(slots: torch.Tensor, length: int) -> torch.Tensor:
    """``slots`` right-aligned in ``length`` columns, -1 marking the padding on the left."""
    return torch.nn.functional.pad(slots, (length - slots.shape[1], 0), value=-1)
