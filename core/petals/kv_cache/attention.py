"""The attention kinds: one session's keys and values of one block, in pages (``petals.kv_cache.base``).

``AttentionCache`` (full attention) keeps every token: a page table per sequence over the block's
``PagePool``, pages taken as the session grows and given back when it rewinds or ends.
``SlidingWindowCache`` (sliding and chunked attention) also gives back the pages that fell out of
its window after each step, so it holds at most ``window - 1`` tokens plus a rewind margin.

A forward sees one or more sessions' caches of a block through ``PagedCache``, a transformers
``Cache`` that answers for the block's own layer index: Hugging Face layers call
``cache.update(key, value, layer_idx)`` exactly as inside the full model. ``update`` writes the new
keys and values into each sequence's pages and hands the layer every row's visible keys and
values, right-aligned and left-padded to the longest row; ``position_ids`` and ``attention_mask``
tell the block each row's positions and which key slots are padding, so rows at different
positions share one batched attention.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from petals.kv_cache.base import KindCache
from petals.kv_cache.pages import PagePool
from petals.kv_cache.specs import ChunkedAttentionSpec, FullAttentionSpec, SlidingWindowSpec

_UNKNOWN = object()


class AttentionCache(KindCache):
    """The full-attention cache of one block in one session: a page table per sequence over the block's
    ``PagePool``, pages taken as the session grows and given back when it rewinds or ends; any position
    it holds is a rewind point, and beams move slot by slot."""

    pool_class = PagePool
    pool: PagePool
    serves = (FullAttentionSpec,)

    @classmethod
    def merged(cls, caches: Sequence[AttentionCache]) -> PagedCache:
        return PagedCache(caches)

    def visible_offset(self, length: int) -> int:
        """The first position a step after ``length`` cached tokens attends to (0: all of them)."""
        return 0

    def slots(self, start: int, end: int) -> torch.LongTensor:
        """``[sequences, end - start]``: where positions ``start..end-1`` of each sequence live in the pool."""
        if self._table_tensor is None:
            tables = torch.tensor(self.tables, dtype=torch.long, device=self.pool.keys.device)
            offsets = torch.arange(self.pool.page_tokens, device=tables.device)
            self._table_tensor = (tables[:, :, None] * self.pool.page_tokens + offsets).flatten(1)
        base = self.first_held
        return self._table_tensor[:, start - base : end - base]

    def contiguous_start(self) -> int | None:
        """The slot of position 0 of a single sequence whose pages lie one after another (as a lone
        session's do): position ``p`` is then slot ``start + p``."""
        if self._contiguous is _UNKNOWN:
            self._contiguous = self._find_contiguous_start()
        return self._contiguous

    def _find_contiguous_start(self) -> int | None:
        if self.num_sequences != 1 or not self.tables[0]:
            return None
        table = self.tables[0]
        if table[-1] - table[0] != len(table) - 1 or any(b - a != 1 for a, b in itertools.pairwise(table)):
            return None
        return (table[0] - self.dropped) * self.pool.page_tokens

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        check_hypo_ids(hypo_ids, self.num_sequences)
        slots = self.slots(self.first_held, self.length)
        sources = slots[hypo_ids.to(slots.device)].flatten()
        for tensor in self.pool.tensors:
            tensor.index_copy_(0, slots.flatten(), tensor.index_select(0, sources))

    def _changed(self) -> None:
        self._table_tensor: torch.Tensor | None = None
        self._contiguous: int | None | object = _UNKNOWN  # contiguous_start(), once computed


class SlidingWindowCache(AttentionCache):
    """A sliding-window (or chunked) attention cache: after each step it gives back the pages whose
    tokens no later query can attend, keeping ``spec.tokens_kept`` tokens (the window and a margin
    for rollback), so it rewinds only as far as that margin (or to 0)."""

    spec: SlidingWindowSpec
    serves = (SlidingWindowSpec, ChunkedAttentionSpec)

    def visible_offset(self, length: int) -> int:
        return max(0, length - (self.spec.window - 1))

    def written(self) -> None:
        drop = max(0, self.length - self.spec.tokens_kept) // self.pool.page_tokens - self.dropped
        if drop > 0:
            self._give_back(0, front=drop)
            self.dropped += drop

    def resumable(self, position: int) -> int:
        position = min(position, self.length)
        return position if position == 0 or self.visible_offset(position) >= self.first_held else 0

    def refusal(self, position: int) -> str:
        return (
            f"cannot rewind to position {position}: this sliding-window cache keeps tokens from "
            f"{self.first_held} on (at most {self.spec.tokens_kept - self.spec.window + 1} tokens of rollback "
            "past its window); start a new session to go further back"
        )


class PagedLayer(CacheLayerMixin):
    """The cache layer of one block, over the sequences of one or more sessions' ``AttentionCache``s."""

    is_compileable = False
    is_croppable = False

    def __init__(self, members: Sequence[AttentionCache]) -> None:  # no super().__init__: keys are properties
        self.members = list(members)
        self.pool = self.members[0].pool
        if any(member.pool is not self.pool for member in self.members):
            raise ValueError("caches computed in one forward must share one page pool")
        self.is_sliding = isinstance(self.members[0].spec, SlidingWindowSpec)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool is allocated up front."""

    @property
    def keys(self) -> torch.Tensor:
        """A copy of the visible keys, ``[rows, kv_heads, length, key_dim]`` (left-padded rows)."""
        return self._read(self._visible_width())[0]

    @property
    def values(self) -> torch.Tensor:
        return self._read(self._visible_width())[1]

    def _visible_width(self) -> int:
        length = self.get_seq_length()
        return length - self.members[0].visible_offset(length)

    def get_seq_length(self) -> int:
        return max(member.length for member in self.members)

    def get_max_length(self) -> int:
        return max(member.max_length for member in self.members)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        length = self.get_seq_length()
        offset = self.members[0].visible_offset(length)
        return length + query_length - offset, offset

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values into each sequence's pages; return every row's visible
        history, right-aligned and left-padded (with zeros) to the longest row."""
        spec = self.pool.spec
        broadcast = key_states.shape[1] != spec.num_kv_heads
        key_states, value_states = _grouped(key_states, spec), _grouped(value_states, spec)
        _check_widths(key_states, value_states, spec)
        new_tokens = key_states.shape[-2]
        length = self.get_seq_length()
        width = length + new_tokens - self.members[0].visible_offset(length)
        for member in self.members:
            member.reserve(new_tokens)
        self.write(
            (self.pool.keys, self.pool.values), (key_states.transpose(1, 2), value_states.transpose(1, 2))
        )
        for member in self.members:
            member.length += new_tokens
        keys, values = self._read(width)
        for member in self.members:
            member.written()
        if broadcast:  # hand back as many heads as the layer gave
            keys = keys.repeat_interleave(spec.group_size, dim=1)
            values = values.repeat_interleave(spec.group_size, dim=1)
        return keys, values

    def write(self, tensors: Sequence[torch.Tensor], states: Sequence[torch.Tensor], back: int = 0) -> None:
        """Write each of ``states`` (``[rows, new tokens, ...]``) into the pool tensor beside it, at each
        row's next positions, or ``back`` tokens before them (beside what the step wrote already)."""
        new_tokens = states[0].shape[1]
        if len(self.members) == 1 and (start := self.members[0].contiguous_start()) is not None:
            first = start + self.members[0].length - back  # consecutive pages: the tokens are one slice
            for tensor, state in zip(tensors, states, strict=True):
                tensor[first : first + new_tokens].copy_(state[0])
            return
        slots = torch.cat(
            [member.slots(member.length - back, member.length - back + new_tokens) for member in self.members]
        ).flatten()
        for tensor, state in zip(tensors, states, strict=True):
            tensor.index_copy_(0, slots, state.flatten(0, 1).to(tensor.dtype))

    def read(self, tensors: Sequence[torch.Tensor], width: int) -> list[torch.Tensor]:
        """The last ``width`` tokens of every row of each pool tensor, ``[rows, width, ...]`` (a row shorter
        than that is padded with zeros on the left)."""
        if len(self.members) == 1 and (start := self.members[0].contiguous_start()) is not None:
            end = start + self.members[0].length  # one sequence in consecutive pages: a view, no copy
            return [tensor[None, end - width : end] for tensor in tensors]
        parts = [member.slots(max(member.length - width, 0), member.length) for member in self.members]
        slots = torch.cat([_left_padded(part, width) for part in parts])
        flat = slots.flatten().clamp(min=0)
        gathered = []
        for tensor in tensors:
            # index_select, not tensor[slots]: the same rows, several times faster (measured: a merged decode step
            # spent 40% of its time in aten::index)
            rows = tensor.index_select(0, flat).view(*slots.shape, *tensor.shape[1:])
            first = 0
            for part in parts:  # zero each short row's left padding
                if part.shape[1] < width:
                    rows[first : first + part.shape[0], : width - part.shape[1]] = 0
                first += part.shape[0]
            gathered.append(rows)
        return gathered

    def _read(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[rows, kv_heads, width, dim]`` of the last ``width`` columns of every row."""
        keys, values = self.read((self.pool.keys, self.pool.values), width)
        return keys.transpose(1, 2), values.transpose(1, 2)


class _AtLayerIndex(Sequence):
    """A cache's layer list as the full model's layers see it: the block's own layer at its index,
    and before it layers that hold nothing (the blocks another server runs)."""

    _NOTHING = DummyLayer()

    def __init__(self, index: int, layer) -> None:
        self.index, self.layer = index, layer

    def __len__(self) -> int:
        return self.index + 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if index == self.index:
            return self.layer
        if 0 <= index < self.index:
            return self._NOTHING
        raise IndexError(index)


class RowsCache(Cache):
    """The transformers ``Cache`` of one block over the rows of several sessions' caches (``members``,
    each with a ``length`` and ``num_sequences``), answering for the block's layer index with ``layer``.

    Rows may sit at different positions: a block takes each row's positions from ``position_ids`` and
    its padding from ``attention_mask`` (keys are left-padded to the longest row).
    """

    def __init__(self, members: Sequence, layer) -> None:
        self.members = list(members)
        self.layer_index = self.members[0].layer_index
        super().__init__(layers=_AtLayerIndex(self.layer_index, layer))
        self.layer = layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(member.length for member in self.members)

    def finish_step(self, new_tokens: int) -> None:
        """The block's forward of ``new_tokens`` tokens returned (``ServerBlockMixin`` calls this): a kind
        whose layer may update its state in place stores it now; keys and values are written already."""

    def _row_lengths(self, device: torch.device | str) -> torch.Tensor:
        lengths = [member.length for member in self.members for _ in range(member.num_sequences)]
        return torch.tensor(lengths, device=device)

    @property
    def rows_aligned(self) -> bool:
        """Whether every row has cached as many tokens (no row is padded)."""
        return all(member.length == self.members[0].length for member in self.members)

    def row_positions(self) -> tuple[tuple[int, int], ...]:
        """``(cached tokens, rows)`` of each member (session), in order: where this step's rows start."""
        return tuple((member.length, member.num_sequences) for member in self.members)

    def position_ids(self, query_length: int, device: torch.device | str = "cpu") -> torch.LongTensor:
        """``[rows, query_length]``: each row's positions of the step's tokens."""
        if self.rows_aligned:  # the common case, one session: no per-row tensor to build
            start = self.members[0].length
            rows = sum(member.num_sequences for member in self.members)
            return torch.arange(start, start + query_length, device=device).expand(rows, query_length)
        return self._row_lengths(device)[:, None] + torch.arange(query_length, device=device)

    def attention_mask(self, query_length: int, device: torch.device | str = "cpu") -> torch.LongTensor:
        """``[rows, cached + query_length]`` (the longest row's): 1 for a key of the row, 0 for padding."""
        lengths = self._row_lengths(device)
        longest = self.get_seq_length()
        slots = torch.arange(longest + query_length, device=device)
        return (slots >= longest - lengths[:, None]).long()


class PagedCache(RowsCache):
    """Several sessions' attention caches of one block, for one batched forward (their rows, in order)."""

    def __init__(self, members: Sequence[AttentionCache], layer: PagedLayer | None = None) -> None:
        super().__init__(members, layer if layer is not None else PagedLayer(members))

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int = 0, *args, **kwargs
    ):
        if layer_idx != self.layer_index:
            raise ValueError(f"layer {layer_idx} wrote into the cache of block {self.layer_index}")
        return self.layer.update(key_states, value_states, *args, **kwargs)


def check_hypo_ids(hypo_ids: torch.Tensor, num_sequences: int) -> None:
    """``ValueError`` unless ``hypo_ids`` has shape ``[num_sequences]`` and picks rows of the batch."""
    if hypo_ids.shape != (num_sequences,):
        raise ValueError(f"hypo_ids must have shape ({num_sequences},), got {tuple(hypo_ids.shape)}")
    if hypo_ids.numel() and not (0 <= int(hypo_ids.min()) and int(hypo_ids.max()) < num_sequences):
        raise ValueError(f"hypo_ids must be in [0, {num_sequences}), got {hypo_ids.tolist()}")


def _grouped(states: torch.Tensor, spec: FullAttentionSpec) -> torch.Tensor:
    if states.shape[1] == spec.num_kv_heads:
        return states
    if states.shape[1] != spec.num_query_heads:
        raise ValueError(
            f"the layer produced {states.shape[1]} key/value heads; its cache spec expects "
            f"{spec.num_kv_heads} (or {spec.num_query_heads} broadcast ones): fix the family's cache_spec"
        )
    return states[:, :: spec.group_size]


def _check_widths(keys: torch.Tensor, values: torch.Tensor, spec: FullAttentionSpec) -> None:
    if keys.shape[-1] != spec.key_dim or values.shape[-1] != spec.value_dim:
        raise ValueError(
            f"the layer produced keys of {keys.shape[-1]} and values of {values.shape[-1]} per head; its cache "
            f"spec says {spec.key_dim} and {spec.value_dim}: fix the family's cache_spec"
        )


def _left_padded(slots: torch.Tensor, length: int) -> torch.Tensor:
    """``slots`` right-aligned in ``length`` columns, -1 marking the padding on the left."""
    return torch.nn.functional.pad(slots, (length - slots.shape[1], 0), value=-1)
