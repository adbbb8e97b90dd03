"""The linear-attention kind: one fixed-size state per sequence, a page of its own.

A gated delta net layer (Qwen3-Next's linear attention) keeps, per sequence, the last inputs of its
causal convolution and one recurrent matrix per head, whatever the sequence's length
(``LinearAttentionSpec``). A block's ``StatePool`` lays each page out as one sequence's slot: the
live state and ``spec.snapshots`` earlier ones. ``LinearAttentionState`` is one session's state of one
block, a ``KindCache`` (``petals.kv_cache.base``) whose page table holds one slot per sequence, taken
when the session opens and given back when it ends (or lent, kept and reclaimed as any kind's pages).

A forward sees one or more sessions' states through ``StateCache``, a transformers ``Cache`` whose
layer at the block's index is a linear-attention layer (``get_conv_state``, ``update_conv_state``,
``get_recurrent_state``, ``update_recurrent_state``, ``has_previous_state``, as transformers' own
``LinearAttentionLayer`` answers them): it gathers the rows of every session, and writes each row's
new state back into its slot when the layer stores its recurrent state, the last thing it does.
Rows at different positions need nothing more: a state has no length.

A state cannot be truncated, so a rewind restores a snapshot: before each step the live state is
copied into the slot's ring of snapshots, and a rewind to the start of one of the last
``spec.snapshots`` steps (or to 0) is exact; any other position is refused in one line. Rewinding
inside a multi-token step (a speculative step of several draft tokens, partly accepted) would need a
state per token, which the layer does not produce: the server refuses it too, and the client rewinds
to that step's start instead and sends the accepted positions again with its next step
(``petals.client.server_session``, which learns how far a block rewinds from ``spec.rewind_steps``).

Snapshots or recomputation? Recomputing would keep a checkpoint state and the block's inputs since
(4 KiB a token in bf16 for Qwen3-Next-80B) and replay the block on a rewind. Measured on this
project's CPU machine (torch 2.13, 2 threads, fp32, shared with a test run, so noisy), with
Qwen3-Next-80B's state (16 key and 32 value heads of 128, kernel 4, hidden size 2048: 2.1 MiB):
a snapshot copies it in 0.3-1 ms (a bare 2 MiB copy: 0.23-0.28 ms); replaying one token through the
layer's mixer alone takes 80-290 ms with transformers' reference kernels (its input projection
alone 5-13 ms), 4 tokens 350-700 ms, before the block's experts. Snapshots cost far less time per
step than one replayed token; they cost ``1 + snapshots`` states of memory per sequence, which the
budget and the planner count (``bytes_per_sequence``), so they are few (``REWIND_STEPS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from petals.kv_cache.arena import PageArena, aligned, field
from petals.kv_cache.attention import AttentionCache, PagedLayer, RowsCache, check_hypo_ids
from petals.kv_cache.base import CacheGroup, KindCache, Pool
from petals.kv_cache.pages import PagePool
from petals.kv_cache.specs import TOKENS_PER_SEQUENCE, HybridSpec, LinearAttentionSpec


class StatePool(Pool):
    """One block's linear-attention states, one sequence's slot to a page of an arena: its live state and
    its snapshots, shared by the block's sessions. ``page_tokens`` is the share of the server's token
    budget one slot stands for (``TOKENS_PER_SEQUENCE``). On a server's ``arena`` the
    slots are pages of the free list every block shares; alone, the pool has ``num_pages`` of its own."""

    spec: LinearAttentionSpec
    unit = "sequence states"

    def __init__(
        self,
        spec: LinearAttentionSpec,
        num_pages: int = 0,
        page_tokens: int = TOKENS_PER_SEQUENCE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        arena: PageArena | None = None,
        home: int = 0,
    ) -> None:
        if arena is None:
            if num_pages < 1:
                raise ValueError(f"a state pool needs sequence slots, got {num_pages}")
            arena = PageArena(num_pages, aligned(self.slot_nbytes(spec, dtype)), device)
        if arena.page_nbytes < self.slot_nbytes(spec, dtype):
            raise ValueError(
                f"a sequence's state takes {self.slot_nbytes(spec, dtype)} bytes, more than a page of {arena.page_nbytes}"
            )
        super().__init__(spec, arena, page_tokens, home)
        copies = 1 + spec.snapshots  # index 0: the live state
        self.conv = field(arena.storage, 0, dtype, (copies, spec.conv_dim, spec.conv_kernel))
        self.recurrent = (  # None: a layer that keeps its convolution's inputs only
            None
            if spec.recurrent_shape is None
            else field(
                arena.storage,
                aligned(self.conv[0].nbytes),
                spec.state_dtype(dtype),
                (copies, *spec.recurrent_shape),
            )
        )

    @staticmethod
    def slot_nbytes(spec: LinearAttentionSpec, dtype: torch.dtype) -> int:
        """Bytes of one sequence's slot: its convolution inputs, then its recurrent state (each with its
        snapshots)."""
        copies = 1 + spec.snapshots
        conv = copies * spec.conv_dim * spec.conv_kernel * dtype.itemsize
        if spec.recurrent_shape is None:
            return conv
        return (
            aligned(conv)
            + copies * torch.Size(spec.recurrent_shape).numel() * spec.state_dtype(dtype).itemsize
        )

    @classmethod
    def page_demand(
        cls, spec: LinearAttentionSpec, dtype: torch.dtype, page_tokens: int
    ) -> tuple[tuple[int, int], ...]:
        """A page holding one sequence's state, a row of its own."""
        slot = cls.slot_nbytes(spec, dtype)
        return ((slot, slot),)

    @classmethod
    def for_budget(
        cls,
        spec: LinearAttentionSpec,
        tokens: int,
        page_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> StatePool:
        """One sequence per ``TOKENS_PER_SEQUENCE`` tokens of the budget."""
        return cls(spec, spec.sequences(tokens), TOKENS_PER_SEQUENCE, dtype, device)

    @classmethod
    def for_session(
        cls,
        spec: LinearAttentionSpec,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> StatePool:
        return cls(spec, max(batch_size, 1), dtype=dtype, device=device)

    @property
    def page_nbytes(self) -> int:
        """Bytes one sequence's slot takes of the arena (its state and snapshots, in a page)."""
        return self.arena.page_nbytes

    def pages_for(self, tokens: int) -> int:
        """A sequence takes one slot, whatever its length (from its start: a state exists at position 0)."""
        return 1

    def max_pages(self, length: int) -> int:
        return 1


class LinearAttentionState(KindCache):
    """The linear-attention state of one block in one session: a slot per sequence in a ``StatePool``
    (its page table holds that one page), with snapshots for rollback. Without a pool it is standalone
    (tests, measurements)."""

    pool_class = StatePool
    pool: StatePool
    spec: LinearAttentionSpec
    serves = (LinearAttentionSpec,)

    def __init__(self, *args, **kwargs) -> None:
        self.snapshots: list[tuple[int, int]] = []  # (position, copy index), oldest first
        super().__init__(*args, **kwargs)

    @classmethod
    def merged(cls, caches: Sequence[LinearAttentionState]) -> StateCache:
        return StateCache(caches)

    @property
    def slots(self) -> list[int]:
        """Each sequence's slot (its one page)."""
        return [table[0] for table in self.tables if table]

    def _changed(self) -> None:
        self._index = torch.tensor(self.slots, dtype=torch.long, device=self.pool.conv.device)

    def _initialize(self, pages: list[int]) -> None:
        """A slot just taken starts from zeros (another kind may have written its page)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.pool.conv.device)
        self.pool.conv[index] = 0
        if self.pool.recurrent is not None:
            self.pool.recurrent[index] = 0

    def snapshot(self) -> None:
        """Keep the live state as it is at this position (before a step changes it), dropping the oldest."""
        if (
            self.length == 0
            or self.spec.snapshots == 0
            or (self.snapshots and self.snapshots[-1][0] == self.length)
        ):
            return
        used = {copy for _, copy in self.snapshots}
        if len(self.snapshots) == self.spec.snapshots:
            used.discard(self.snapshots.pop(0)[1])
        copy = min(set(range(1, 1 + self.spec.snapshots)) - used)
        self._copy(0, copy)
        self.snapshots.append((self.length, copy))

    def stepped(self, new_tokens: int) -> None:
        """Called once a step's new state is written: the live state is ``new_tokens`` further on."""
        self.advance(new_tokens)

    def resumable(self, position: int) -> int:
        """``position`` if it is 0, the live state's or a snapshot's position; else the latest of those
        before it."""
        position = min(position, self.length)
        kept = {0, self.length, *(kept for kept, _ in self.snapshots)}
        return max(point for point in kept if point <= position)

    def refusal(self, position: int) -> str:
        kept = ", ".join(str(kept) for kept, _ in self.snapshots) or "none"
        return (
            f"cannot rewind to position {position}: a linear-attention state goes back only to the start "
            f"of one of its last {self.spec.snapshots} steps (kept: {kept}) or to 0; start a new session "
            "to go elsewhere"
        )

    def restore(self, position: int) -> None:
        """The snapshot of ``position`` becomes the live state (zeros at 0)."""
        if position == 0:
            self._zero(slice(None))
            self.snapshots.clear()
            return
        self._copy(dict(self.snapshots)[position], 0)
        self.snapshots = [(kept, index) for kept, index in self.snapshots if kept < position]

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Reorder the batch (beam search): row ``i`` becomes old row ``hypo_ids[i]``, snapshots included."""
        check_hypo_ids(hypo_ids, self.num_sequences)
        sources = self._index[hypo_ids.to(self._index.device)]
        self.pool.conv[self._index] = self.pool.conv[sources]
        if self.pool.recurrent is not None:
            self.pool.recurrent[self._index] = self.pool.recurrent[sources]

    def _copy(self, source: int, target: int) -> None:
        """Copy each sequence's state ``source`` (0: the live one) onto its state ``target``: slot by slot,
        as plain copies (an indexed copy of all slots at once takes 10x longer for one sequence)."""
        for slot in self.slots:
            self.pool.conv[slot, target].copy_(self.pool.conv[slot, source])
            if self.pool.recurrent is not None:
                self.pool.recurrent[slot, target].copy_(self.pool.recurrent[slot, source])

    def _zero(self, copies: slice) -> None:
        self.pool.conv[self._index, copies] = 0
        if self.pool.recurrent is not None:
            self.pool.recurrent[self._index, copies] = 0


class StateLayer(LinearAttentionCacheLayerMixin):
    """The linear-attention cache layer of one block over the rows of one or more sessions' states.

    Rows are gathered from the slots once per forward (snapshotting them first). The step's new state
    goes back into the slots when the layer stores its recurrent state (``update_recurrent_state``, the
    last thing a gated delta net does), or, for a layer that stores none (a short convolution, a Mamba
    decode step updating the gathered states in place), when the block's forward returns
    (``finish``, which ``ServerBlockMixin`` calls with the step's token count).
    """

    def __init__(self, members: Sequence[LinearAttentionState]) -> None:
        super().__init__(number_of_states=1)
        self.members = list(members)
        self.pool = self.members[0].pool
        if any(member.pool is not self.pool for member in self.members):
            raise ValueError("states computed in one forward must share one state pool")
        self.index = torch.cat([member._index for member in self.members])
        self.previous = any(member.length > 0 for member in self.members)
        self.has_previous_state[0] = self.previous
        self.dtype, self.device = self.pool.conv.dtype, self.pool.conv.device
        self.conv_kernel_size[0] = self.pool.spec.conv_kernel
        self._new_tokens = 1  # a step that calls no update_conv_state is a fused single-token decode
        self._gathered = False
        self._stored = False
        self._stepped = False

    def _gather(self) -> None:
        """Read every row's live state (a session at position 0 reads zeros), snapshotting it first."""
        if self._gathered:
            return
        if self._stored:
            raise RuntimeError("a layer read its state after storing this step's: one forward is one step")
        for member in self.members:
            member.snapshot()
        self.conv_states[0] = self.pool.conv[self.index, 0]
        self.is_conv_states_initialized[0] = True
        if self.pool.recurrent is not None:
            self.recurrent_states[0] = self.pool.recurrent[self.index, 0]
            self.is_recurrent_states_initialized[0] = True
        self._gathered = True

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        """Nothing to do: the pool is allocated up front."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The convolution's inputs with the rows' previous ones in front (zeros, or none before any state)."""
        self._gather()
        _check_shape("conv states", conv_states.shape[1:-1], (self.pool.spec.conv_dim,))
        self._new_tokens = conv_states.shape[-1]
        kernel = self.pool.spec.conv_kernel
        if self.previous:
            full = torch.cat([self.conv_states[0].to(conv_states.dtype), conv_states], dim=-1)
        else:
            full = torch.nn.functional.pad(conv_states, (max(0, kernel - conv_states.shape[-1]), 0))
        self.conv_states[0] = full[..., -kernel:]
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Keep the step's recurrent state and store the step's states into each row's slot."""
        self._gather()
        if self.pool.recurrent is None:
            raise ValueError(
                "the layer stored a recurrent state; its cache spec says it keeps none: fix the family's cache_spec"
            )
        _check_shape("recurrent states", recurrent_states.shape[1:], self.pool.spec.recurrent_shape)
        self.recurrent_states[0] = recurrent_states
        self._store()
        self._step(self._new_tokens)
        return recurrent_states

    def finish(self, new_tokens: int) -> None:
        """The block's forward of ``new_tokens`` tokens returned: store what the layer left in the
        gathered states (once), and move every row ``new_tokens`` further on."""
        if not self._stored:
            self._gather()
            self._store()
        self._step(new_tokens)

    def _step(self, new_tokens: int) -> None:
        if not self._stepped:
            for member in self.members:
                member.stepped(new_tokens)
            self._stepped = True

    def _store(self) -> None:
        if self._stored:
            return
        self.pool.conv[self.index, 0] = self.conv_states[0].to(self.pool.conv.dtype)
        if self.pool.recurrent is not None:
            self.pool.recurrent[self.index, 0] = self.recurrent_states[0].to(self.pool.recurrent.dtype)
        self._stored = True


class StateCache(RowsCache):
    """Several sessions' linear-attention states of one block, for one batched forward (their rows, in order)."""

    def __init__(self, members: Sequence[LinearAttentionState], layer: StateLayer | None = None) -> None:
        super().__init__(members, layer if layer is not None else StateLayer(members))

    def finish_step(self, new_tokens: int) -> None:
        """The block's forward returned (``ServerBlockMixin`` calls this): store the step's states."""
        self.layer.finish(new_tokens)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check_index(layer_idx)
        if not self.layer.previous:
            return None
        self.layer._gather()
        return self.layer.conv_states[0]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check_index(layer_idx)
        if not self.layer.previous:
            return None
        self.layer._gather()
        return self.layer.recurrent_states[0]

    def _check_index(self, layer_idx: int) -> None:
        if layer_idx != self.layer_index:
            raise ValueError(f"layer {layer_idx} read the state of block {self.layer_index}")


class HybridPool:
    """One hybrid block's memory: a ``PagePool`` of keys and values and a ``StatePool`` of sequence
    states (``parts``), on the server's arena or each on its own; the server's budget admits a session
    when the pages both parts need are free."""

    def __init__(self, spec: HybridSpec, attention: PagePool, state: StatePool) -> None:
        self.spec, self.attention, self.state = spec, attention, state
        self.parts = (attention, state)

    @property
    def nbytes(self) -> int:
        arenas = {id(part.arena): part.arena for part in self.parts}
        return sum(arena.nbytes for arena in arenas.values())


class HybridCache(CacheGroup):
    """One session's cache of a hybrid block: its keys and values (``attention``, kept by the manager of
    their kind in ``MANAGERS``) and its state (``state``, a ``LinearAttentionState``), grown, rewound,
    reordered and released together. A rewind goes only where the state can go (the start of one of
    its last steps, or 0)."""

    serves = (HybridSpec,)

    def __init__(
        self,
        spec: HybridSpec,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        pool: HybridPool | None = None,
        layer_index: int = 0,
        lease: Any = None,
    ) -> None:
        attention = _attention_manager(spec)
        if pool is None:
            self.attention = attention(
                spec.attention, batch_size, max_length, dtype, device, layer_index=layer_index
            )
            self.state = LinearAttentionState(
                spec.state, batch_size, max_length, dtype, device, layer_index=layer_index
            )
        else:
            self.attention = attention.paged(pool.attention, batch_size, max_length, layer_index, lease)
            try:
                self.state = LinearAttentionState.paged(
                    pool.state, batch_size, max_length, layer_index, lease
                )
            except BaseException:
                self.attention.release()
                raise
        super().__init__((self.attention, self.state))
        self.spec, self.layer_index = spec, layer_index

    @classmethod
    def make_pool(
        cls,
        spec: HybridSpec,
        tokens: int,
        page_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        arena: PageArena | None = None,
        home: int = 0,
    ) -> HybridPool:
        """A block's pools, pages of keys and values and sequence states: both on a server's ``arena``,
        or each of its own for a budget of ``tokens`` tokens."""
        where = {"arena": arena, "home": home}
        attention = _attention_manager(spec).make_pool(
            spec.attention, tokens, page_tokens, dtype, device, **where
        )
        state = LinearAttentionState.make_pool(spec.state, tokens, page_tokens, dtype, device, **where)
        return HybridPool(spec, attention, state)

    @staticmethod
    def page_demand(spec: HybridSpec, dtype: torch.dtype, page_tokens: int) -> tuple[tuple[int, int], ...]:
        return (
            *_attention_manager(spec).page_demand(spec.attention, dtype, page_tokens),
            *LinearAttentionState.page_demand(spec.state, dtype, page_tokens),
        )

    @classmethod
    def paged(
        cls, pool: HybridPool, batch_size: int, max_length: int, layer_index: int = 0, lease: Any = None
    ) -> HybridCache:
        return cls(pool.spec, batch_size, max_length, pool=pool, layer_index=layer_index, lease=lease)

    @staticmethod
    def merged(caches: Sequence[HybridCache]) -> HybridRowsCache:
        return HybridRowsCache(caches)

    def view(self) -> HybridRowsCache:
        return HybridRowsCache([self])


def _attention_manager(spec: HybridSpec) -> type[AttentionCache]:
    """The manager of a hybrid block's attention part: its kind's, from the table of managers."""
    from petals.kv_cache import manager_for  # its refusals live beside the table

    return manager_for(spec.attention, "a hybrid block's attention")


class HybridLayer(StateLayer, CacheLayerMixin):
    """The cache layer of a hybrid block: the rows' states (as ``StateLayer``) and their keys and values
    (a ``PagedLayer``, which ``update`` and the mask sizes go to)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, members: Sequence[HybridCache]) -> None:
        StateLayer.__init__(self, [member.state for member in members])
        self.attention = PagedLayer([member.attention for member in members])
        self.is_sliding = self.attention.is_sliding
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.attention.keys

    @property
    def values(self) -> torch.Tensor:
        return self.attention.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.attention.update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.attention.get_seq_length()

    def get_max_length(self) -> int:
        return self.attention.get_max_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.get_mask_sizes(query_length)


class HybridRowsCache(StateCache):
    """Several sessions' hybrid caches of one block, for one batched forward (their rows, in order)."""

    def __init__(self, members: Sequence[HybridCache]) -> None:
        super().__init__(members, HybridLayer(members))

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int = 0, *args, **kwargs
    ):
        if layer_idx != self.layer_index:
            raise ValueError(f"layer {layer_idx} wrote into the cache of block {self.layer_index}")
        return self.layer.update(key_states, value_states, *args, **kwargs)


def _check_shape(name: str, got: Sequence[int], expected: Sequence[int]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(
            f"the layer produced {name} of shape {tuple(got)} per sequence; its cache spec says "
            f"{tuple(expected)}: fix the family's cache_spec"
        )
