"""The server's cache budget, in bytes: an arena of equal-byte pages per device, and which sessions may start.

The budget is bytes: by default what ``--attn_cache_tokens`` tokens of each hosted block's kind take
(``CacheSpec.budget_bytes``: keys and values of that many tokens, or for a block of fixed-size
states one sequence per ``TOKENS_PER_SEQUENCE`` tokens), summed over the blocks, as the planner
counts it. Those bytes are one ``PageArena`` per device, whose pages every block's pool shares:
an attention pool keeps as many tokens in a page as fit (``page_tokens``, its kind's), a state pool
one sequence's state. Sessions take pages as they grow and give them back when they rewind, slide
past their window or end, so memory goes to whichever kind needs it: a Gemma 3 server whose sliding
blocks hold a window each lends the rest to its full-attention blocks. ``max_length`` only caps a
session; it reserves nothing.

Admission counts pages, i.e. bytes: a session is admitted when what it could ever hold (each block's
kind's pages for ``max_length``: a sliding window holds at most its window) fits the arena, and the
pages of its first step are free now, or as soon as pages are given back (arenas wake admission;
nothing polls). One that later finds no free page fails alone with a clear error
(``OutOfPagesError``), its neighbours' pages untouched.

What we announce follows Petals' unit: ``cache_tokens_left`` (and rpc_info's
``cache_tokens_available``) count keys and values separately and sum over blocks, i.e.
``2 × blocks × L``, where ``L`` is the longest one-sequence session the free pages could hold now in
every hosted block; Petals clients check ``max_length × 2 × span_length <= cache_tokens_left``.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from petals.kv_cache import PAGE_TOKENS, HybridPool, PageArena, PagePool, SessionCache, StatePool, pool_parts
from petals.kv_cache.arena import page_nbytes_for
from petals.server.backend import BlockBackend


class AllocationFailed(RuntimeError):
    """Not enough KV-cache memory for a session (now, or ever)."""


class CacheBudget:
    """The hosted blocks' arenas and pools; admission is decided in the server's event loop.

    ``nbytes``: the budget in bytes (default: ``tokens_per_block`` tokens of each block's kind), split
    over devices as the blocks' shards lie on them.
    """

    def __init__(
        self,
        backends: Sequence[BlockBackend],
        tokens_per_block: int,
        page_tokens: int = PAGE_TOKENS,
        nbytes: int | None = None,
    ):
        page_tokens = max(1, min(page_tokens, tokens_per_block))
        demands: dict[torch.device, list[tuple[int, int]]] = defaultdict(list)
        planned: dict[torch.device, int] = defaultdict(int)
        for backend in backends:
            for device, demand in backend.page_demands(page_tokens):
                demands[device].append(demand)
            for spec, device in zip(backend.shard_specs, backend.devices, strict=True):
                planned[torch.device(device)] += spec.budget_bytes(tokens_per_block, backend.dtype)
        total = sum(planned.values())
        self.arenas: dict[torch.device, PageArena] = {}
        for device, needs in demands.items():
            share = planned[device] if nbytes is None else nbytes * planned[device] // max(total, 1)
            page_nbytes = page_nbytes_for(needs)
            # at least a page for each pool: one sequence can always start
            self.arenas[device] = PageArena(max(len(needs), share // page_nbytes), page_nbytes, device)
        # each block's pools look for pages first at its own stretch of its devices' arenas (a lone session's
        # pages then lie in a row in each block)
        keeping = [backend for backend in backends if backend.page_demands(page_tokens)]
        stretch = {backend.uid: index / len(keeping) for index, backend in enumerate(keeping)}
        self.pools: dict[str, list[PagePool | StatePool | HybridPool]] = {}
        for backend in backends:
            arena = self.arenas.get(torch.device(backend.devices[0]))
            home = 0 if arena is None else int(stretch.get(backend.uid, 0) * arena.num_pages)
            self.pools[backend.uid] = backend.make_pools(tokens_per_block, page_tokens, self.arenas, home)
        # what admission counts: each pool, or each part of a hybrid block's (its pages and its states)
        self.parts: dict[str, list[PagePool | StatePool]] = {
            uid: [part for pool in pools for part in pool_parts(pool)] for uid, pools in self.pools.items()
        }
        # the blocks tokens_left counts: those with parts of their own, and those that reuse the keys and
        # values of a hosted block (a session's tokens there are held by its source's)
        uids = {backend.index: backend.uid for backend in backends}
        self.counted = [
            backend.uid
            for backend in backends
            if self.parts[backend.uid] or self.parts.get(uids.get(backend.cache_spec.reads_from, ""))
        ]
        self._all_parts = [part for parts in self.parts.values() for part in parts]
        self._longest: tuple[tuple[int, ...], int] | None = None  # (free pages per arena, L), last computed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._freed = asyncio.Event()
        for arena in self.arenas.values():
            arena.on_free.append(self._pages_freed)

    def _pages_freed(self) -> None:
        """A pool gave pages back (in any thread): wake the sessions waiting for admission."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._freed.set)

    @property
    def tokens_left(self) -> int:
        """In Petals' unit: ``2 × blocks × L``, ``L`` the longest one-sequence session the free pages could
        hold now in every hosted block (keys and values counted separately, summed over blocks)."""
        return 2 * len(self.counted) * self.longest_session()

    def longest_session(self) -> int:
        """The most tokens one new sequence could reach in every hosted block with the pages free now
        (a block of states needs one page for any length; up to what the whole arena would hold)."""
        free = tuple(arena.free_pages for arena in self.arenas.values())
        if self._longest is not None and self._longest[0] == free:
            return self._longest[1]
        # the last length that fits, and the first one known not to (past what the whole arena would hold)
        low, high = 0, 1 + max((part.num_pages * part.page_tokens for part in self._all_parts), default=0)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self._fits(middle) else (low, middle)
        self._longest = (free, low)
        return low

    def _fits(self, length: int) -> bool:
        needed = self._pages(self._all_parts, lambda part: part.max_pages(length))
        return all(pages <= arena.free_pages for arena, pages in needed.items())

    @property
    def nbytes(self) -> int:
        """The budget: bytes of the arenas."""
        return sum(arena.nbytes for arena in self.arenas.values())

    @property
    def bytes_left(self) -> int:
        """Bytes of the arenas' free pages."""
        return sum(arena.free_pages * arena.page_nbytes for arena in self.arenas.values())

    @property
    def bytes_used(self) -> int:
        return self.nbytes - self.bytes_left

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes the sessions hold now, by cache kind (what ``petals health`` and the monitor show)."""
        held: dict[str, int] = defaultdict(int)
        for part in self._all_parts:
            held[part.spec.kind] += part.pages_held * part.arena.page_nbytes
        return dict(held)

    async def admit(
        self,
        backends: Sequence[BlockBackend],
        batch_size: int,
        max_length: int,
        first_tokens: int,
        timeout: float,
    ) -> None:
        """Check that a session could ever fit, and wait up to ``timeout`` s for its first step's pages."""
        self._loop = asyncio.get_running_loop()
        parts = self._parts_of(backends)
        ever = self._pages(parts, lambda part: max(part.max_pages(max_length), part.pages_for(first_tokens)))
        for arena, pages in ever.items():
            if pages * batch_size > arena.num_pages:
                raise AllocationFailed(
                    f"this session needs {_size(pages * batch_size * arena.page_nbytes)} of cache "
                    f"({batch_size} × {max_length} tokens: {batch_size} × {pages} pages of "
                    f"{_size(arena.page_nbytes)}) but the server's whole budget is {_size(arena.nbytes)}; "
                    "use a smaller max_length or batch"
                )
        first = self._pages(parts, lambda part: part.pages_for(first_tokens))
        deadline = time.monotonic() + timeout
        while True:
            self._freed.clear()  # before looking: a page given back after this wakes the wait below
            short = [
                (arena, pages * batch_size)
                for arena, pages in first.items()
                if arena.free_pages < pages * batch_size
            ]
            if not short:
                return
            if (remaining := deadline - time.monotonic()) <= 0:
                arena, pages = short[0]
                raise AllocationFailed(
                    f"not enough KV cache: this session's first step needs {_size(pages * arena.page_nbytes)} "
                    f"({pages} pages), {_size(arena.free_pages * arena.page_nbytes)} are free; "
                    "try again later or another server"
                )
            try:
                await asyncio.wait_for(self._freed.wait(), remaining)
            except TimeoutError:
                pass

    @staticmethod
    def _pages(parts: Iterable[PagePool | StatePool], pages_of) -> dict[PageArena, int]:
        """Pages one sequence needs of each arena, summed over ``parts`` (``pages_of(part)`` each)."""
        needed: dict[PageArena, int] = defaultdict(int)
        for part in parts:
            needed[part.arena] += pages_of(part)
        return needed

    def _parts_of(self, backends: Sequence[BlockBackend]) -> list[PagePool | StatePool]:
        return [part for backend in backends for part in self.parts[backend.uid]]

    def open_caches(
        self, backends: Sequence[BlockBackend], batch_size: int, max_length: int
    ) -> list[SessionCache]:
        """A session's caches on ``backends``' pools (they take pages as the session grows); none if one fails."""
        caches: list[SessionCache] = []
        try:
            for backend in backends:
                caches.append(backend.open_cache(self.pools[backend.uid], batch_size, max_length))
        except BaseException:
            for cache in caches:
                cache.release()
            raise
        return caches


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
