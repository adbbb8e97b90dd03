"""The cache a server keeps for its blocks: a spec per cache kind, and one class per kind over one base.

Each block's cache is described by a spec (``petals.kv_cache.specs``: full attention with keys and
values of their own widths, sliding window, chunked, indexed, linear-attention state, hybrid, shared),
which a family's ``cache_spec`` hook returns (core's default reads transformers' own per-layer kinds;
DeepSeek's plugin returns its latent as full attention of its own widths). ``MANAGERS`` picks the class
that keeps one session's cache of that kind: each registers itself for the spec types it ``serves``, so
adding a kind is its spec, its module (imported here) and its tests. Every one is a ``KindCache``
(``petals.kv_cache.base``):
page tables over the block's pool, grown, rewound, released and counted once, each kind stating only
its row layout (its ``Pool``) and its rewind rule. The engine, the sessions and tensor-parallel shards
use them through one protocol (``SessionCache``), without asking which kind they hold:

* ``position``, ``nbytes``, ``max_length``; ``reserve(new_tokens)`` before a step, ``rewind(position)``,
  ``resumable(position)`` (how far back it can go), ``reorder(hypo_ids)``, ``release()``;
* ``merged(caches)`` / ``view()``: the transformers ``Cache`` a block's forward is given, over one
  or several sessions' rows (``PagedCache``, ``StateCache``), answering for the block's own layer index;
* ``make_pool(spec, tokens, page_tokens, dtype, device, arena=...)``: a block's memory for its
  sessions, on the server's arena (or of its own for ``tokens`` tokens: tests, measurements);
* ``page_demand(spec, dtype, page_tokens)``: the bytes of a page the kind needs, and of its rows
  (what the arena's page size is made from).

A server's memory for its sessions is one ``PageArena`` per device (``petals.kv_cache.arena``): pages
of equal bytes on one free list, which every block's pool lays out its own way, so memory goes to
whichever kind needs it and the server's budget and admission count bytes (pages). Attention kinds
keep keys and values in a ``PagePool`` per block, a page holding as many tokens as fit, taken as
sessions grow and given back when they rewind, slide past their window or end. Linear attention
(``LinearAttentionSpec``) keeps a fixed-size state per sequence instead, a page of a ``StatePool``
(``petals.kv_cache.states``). A hybrid layer (``HybridSpec``) keeps both (``HybridCache``, a
``CacheGroup``). Indexed attention keeps its indexer's keys in the pages of its keys and values
(``petals.kv_cache.indexed``). A layer that reuses an earlier layer's keys and values (``SharedKVSpec``)
keeps nothing (``petals.kv_cache.shared``); ``closed_boundaries`` says where spans of blocks must not
split it from its source. A feed-forward layer listed among the layer types (``StatelessSpec``) keeps
nothing either (``petals.kv_cache.stateless``).

Whose pages are they? Each session's, on a ``Lease`` (``petals.kv_cache.lending``): live, lent while the
session is idle, kept after it ended for its client to continue, and reclaimed (least recently used
first) or preempted (the most recently admitted session first) when a session needs pages and none
is free.
"""

from __future__ import annotations

from typing import Protocol

import torch

from petals.kv_cache.arena import PageArena
from petals.kv_cache.attention import (
    AttentionCache,
    PagedCache,
    PagedLayer,
    RowsCache,
    SlidingWindowCache,
    check_hypo_ids,
)
from petals.kv_cache.base import (
    MANAGERS,
    CacheGroup,
    KindCache,
    Pool,
    SessionPreempted,
    ShardCaches,
    furthest_common,
)
from petals.kv_cache.indexed import IndexedAttentionCache, IndexedPagedCache, IndexedPagePool
from petals.kv_cache.lending import Lease, Lender
from petals.kv_cache.pages import PAGE_TOKENS, CacheOverflowError, OutOfPagesError, PagePool
from petals.kv_cache.shared import SharedKVCache, SharedKVPool
from petals.kv_cache.specs import (
    REWIND_MARGIN,
    REWIND_STEPS,
    TOKENS_PER_SEQUENCE,
    CacheSpec,
    ChunkedAttentionSpec,
    FullAttentionSpec,
    HybridSpec,
    IndexedAttentionSpec,
    LinearAttentionSpec,
    SharedKVSpec,
    SlidingWindowSpec,
    StatelessSpec,
    UnservedSpec,
    check_span,
    closed_boundaries,
    describe_block,
    kv_source,
)
from petals.kv_cache.stateless import StatelessCache
from petals.kv_cache.states import (
    HybridCache,
    HybridPool,
    HybridRowsCache,
    LinearAttentionState,
    StateCache,
    StatePool,
)


class UnservedCacheKindError(NotImplementedError):
    """A block's cache kind has no manager in petals-core yet."""


class SessionCache(Protocol):
    """What the engine needs of one session's cache of one block, whatever its kind (or shards): every
    method it calls, none probed for."""

    max_length: int  # set anew when a kept session is continued

    @property
    def position(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def reserve(self, new_tokens: int) -> None: ...
    def resumable(self, position: int) -> int: ...
    def rewind(self, position: int) -> None: ...
    def reorder(self, hypo_ids: torch.Tensor) -> None: ...
    def release(self) -> None: ...
    def view(self): ...
    @staticmethod
    def merged(caches): ...


def manager_for(spec: CacheSpec, block: str = "this block") -> type[SessionCache]:
    """The manager class of ``spec``'s kind, or one line saying the kind is not served."""
    manager = MANAGERS.get(type(spec))
    if manager is None:
        served = ", ".join(sorted({kind.kind.replace("_", " ") for kind in MANAGERS}))
        article = "an" if spec.describe()[:1] in "aeiou" else "a"
        if isinstance(spec, UnservedSpec) and spec.reason:
            raise UnservedCacheKindError(
                f"{block} is {article} {spec.describe()} layer, not served: {spec.reason}"
            )
        if spec.kind == "unserved" and spec.describe() in served.split(", "):
            raise UnservedCacheKindError(
                f"{block} is {article} {spec.describe()} layer, whose sizes core cannot read from its config: "
                "petals-core serves this kind where the model type's plugin returns its spec from the "
                "cache_spec hook, and this plugin returns none"
            )
        raise UnservedCacheKindError(
            f"{block} is {article} {spec.describe()} layer, which petals-core cannot cache yet (it serves {served}); "
            "serve other blocks, or a plugin may return a served kind from its cache_spec hook"
        )
    return manager


def open_cache(
    spec: CacheSpec,
    batch_size: int,
    max_length: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    pool: Pool | HybridPool | None = None,
    layer_index: int = 0,
    lease: Lease | None = None,
) -> SessionCache:
    """One session's cache of a block of kind ``spec``: on ``pool`` (its pages counted on ``lease``), or
    standalone (all of ``max_length`` up front: tests and measurements)."""
    manager = manager_for(spec, f"block {layer_index}")
    if pool is not None:
        return manager.paged(pool, batch_size, max_length, layer_index, lease)
    return manager(spec, batch_size, max_length, dtype, device, layer_index=layer_index)


__all__ = [
    "MANAGERS",
    "PAGE_TOKENS",
    "REWIND_MARGIN",
    "REWIND_STEPS",
    "TOKENS_PER_SEQUENCE",
    "AttentionCache",
    "CacheGroup",
    "CacheOverflowError",
    "CacheSpec",
    "ChunkedAttentionSpec",
    "FullAttentionSpec",
    "HybridCache",
    "HybridPool",
    "HybridRowsCache",
    "HybridSpec",
    "IndexedAttentionCache",
    "IndexedAttentionSpec",
    "IndexedPagePool",
    "IndexedPagedCache",
    "KindCache",
    "Lease",
    "Lender",
    "LinearAttentionSpec",
    "LinearAttentionState",
    "OutOfPagesError",
    "PageArena",
    "PagePool",
    "PagedCache",
    "PagedLayer",
    "Pool",
    "RowsCache",
    "SessionCache",
    "SessionPreempted",
    "ShardCaches",
    "SharedKVCache",
    "SharedKVPool",
    "SharedKVSpec",
    "SlidingWindowCache",
    "SlidingWindowSpec",
    "StateCache",
    "StatePool",
    "StatelessCache",
    "StatelessSpec",
    "UnservedCacheKindError",
    "UnservedSpec",
    "check_hypo_ids",
    "check_span",
    "closed_boundaries",
    "describe_block",
    "furthest_common",
    "kv_source",
    "manager_for",
    "open_cache",
]
