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
pages of its first step are available now (free, or lent by idle and kept sessions), or as soon as
pages are given back (arenas wake admission; nothing polls). Sessions that wait do so in one queue,
first come first served, each for at most its ``alloc_timeout``; a refusal says how long a wait to
expect (``wait_estimate``: from how long sessions have held their pages). Each admitted session gets a
lease (``petals.kv_cache.lending``): a session that later finds no free page takes idle and kept
sessions' pages, then preempts the most recently admitted live session, and never fails for memory
itself unless it is that session.

What we announce follows Petals' unit: ``cache_tokens_left`` (and rpc_info's
``cache_tokens_available``) count keys and values separately and sum over blocks, i.e.
``2 × blocks × L``, where ``L`` is the longest one-sequence session the free pages could hold now in
every hosted block; Petals clients check ``max_length × 2 × span_length <= cache_tokens_left``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from petals.kv_cache import (
    PAGE_TOKENS,
    HybridPool,
    Lease,
    Lender,
    PageArena,
    Pool,
    SessionCache,
    SessionPreempted,
)
from petals.kv_cache.arena import page_nbytes_for
from petals.kv_cache.lending import KEPT_SECONDS, MAX_KEPT_SESSIONS
from petals.server.backend import BlockBackend

MAX_WAITING = 64  # sessions waiting for admission at once; more are refused at once


class AllocationFailed(RuntimeError):
    """Not enough KV-cache memory for a session (now, or ever)."""


class CacheBudget:
    """The hosted blocks' arenas and pools; admission is decided in the server's event loop.

    ``nbytes``: the budget in bytes (default: ``tokens_per_block`` tokens of each block's kind), split
    over devices as the blocks' shards lie on them. ``clock``, ``max_kept``, ``kept_seconds``: the
    lender's (``petals.kv_cache.lending``).
    """

    def __init__(
        self,
        backends: Sequence[BlockBackend],
        tokens_per_block: int,
        page_tokens: int = PAGE_TOKENS,
        nbytes: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_kept: int = MAX_KEPT_SESSIONS,
        kept_seconds: float = KEPT_SECONDS,
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
        self.lock = threading.RLock()  # one for all arenas: a session's pages may lie on several
        self.lender = Lender(self.lock, clock, max_kept, kept_seconds)
        self.arenas: dict[torch.device, PageArena] = {}
        for device, needs in demands.items():
            share = planned[device] if nbytes is None else nbytes * planned[device] // max(total, 1)
            page_nbytes = page_nbytes_for(needs)
            # at least a page for each pool: one sequence can always start
            arena = PageArena(max(len(needs), share // page_nbytes), page_nbytes, device, lock=self.lock)
            arena.lender = self.lender
            self.arenas[device] = arena
        # each block's pools look for pages first at its own stretch of its devices' arenas (a lone session's
        # pages then lie in a row in each block)
        keeping = [backend for backend in backends if backend.page_demands(page_tokens)]
        stretch = {backend.uid: index / len(keeping) for index, backend in enumerate(keeping)}
        self.pools: dict[str, list[Pool | HybridPool]] = {}
        for backend in backends:
            arena = self.arenas.get(torch.device(backend.devices[0]))
            home = 0 if arena is None else int(stretch.get(backend.uid, 0) * arena.num_pages)
            self.pools[backend.uid] = backend.make_pools(tokens_per_block, page_tokens, self.arenas, home)
        # what admission counts: each pool, or each part of a hybrid block's (its pages and its states)
        self.parts: dict[str, list[Pool]] = {
            uid: [part for pool in pools for part in pool.parts] for uid, pools in self.pools.items()
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
        self._waiting: collections.deque[object] = collections.deque()  # admission's queue, in order
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
        """The most tokens one new sequence could reach in every hosted block with the pages available
        now (free or lent; a block of states needs one page for any length; up to what the whole arena
        would hold)."""
        free = tuple(arena.available_pages for arena in self.arenas.values())
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
        return all(pages <= arena.available_pages for arena, pages in needed.items())

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

    @property
    def bytes_kept(self) -> int:
        """Bytes of the pages idle and kept sessions lend (used, yet available)."""
        return sum(arena.kept_pages * arena.page_nbytes for arena in self.arenas.values())

    def page_counts(self) -> dict[str, int]:
        """Pages by use, over every arena: held by live sessions, lent (idle and kept sessions'), free."""
        counts: dict[str, int] = collections.Counter()
        for arena in self.arenas.values():
            counts.update(self.lender.pages(arena))
        return {use: counts[use] for use in ("live", "kept", "free")}

    def queue(self) -> dict[str, float | int | None]:
        """Sessions waiting for admission, and about how long a session opened now would wait."""
        return {"waiting": len(self._waiting), "wait_seconds": self.wait_estimate(len(self._waiting))}

    def wait_estimate(self, ahead: int) -> float | None:
        """Seconds until pages for a session with ``ahead`` sessions in line before it are likely given
        back: each live session holds its pages ``mean_lifetime`` seconds (None: none ended yet)."""
        mean = self.lender.mean_lifetime
        if mean is None:
            return None
        return round(mean * (ahead + 1) / max(1, len(self.lender)), 1)

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
        span: Hashable = None,
    ) -> Lease:
        """Check that a session could ever fit, and wait in line up to ``timeout`` s for its first step's
        pages; its lease (``span``: what a later session continuing it must match)."""
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
        first = {
            arena: pages * batch_size
            for arena, pages in self._pages(parts, lambda part: part.pages_for(first_tokens)).items()
        }
        if len(self._waiting) >= MAX_WAITING:
            raise AllocationFailed(self._refusal(first, len(self._waiting)))
        deadline = time.monotonic() + timeout
        turn = object()
        self._waiting.append(turn)
        try:
            while True:
                self._freed.clear()  # before looking: a page given back after this wakes the wait below
                if self._waiting[0] is turn and not self._short(first):
                    return self.lender.admit(span)
                if (remaining := deadline - time.monotonic()) <= 0:
                    raise AllocationFailed(self._refusal(first, self._waiting.index(turn)))
                try:
                    await asyncio.wait_for(self._freed.wait(), remaining)
                except TimeoutError:
                    pass
        finally:
            self._waiting.remove(turn)
            self._freed.set()  # the next in line looks again

    def _short(self, first: dict[PageArena, int]) -> list[tuple[PageArena, int]]:
        """The arenas with fewer pages available than ``first`` needs of them."""
        return [(arena, pages) for arena, pages in first.items() if arena.available_pages < pages]

    def _refusal(self, first: dict[PageArena, int], ahead: int) -> str:
        arena, pages = next(iter(self._short(first) or first.items()))
        line = f"; {ahead} session{'s' * (ahead != 1)} wait ahead in line" if ahead else ""
        estimate = self.wait_estimate(ahead)
        expect = f"; expect room in about {estimate:g} s" if estimate is not None else ""
        return (
            f"not enough KV cache: this session's first step needs {_size(pages * arena.page_nbytes)} "
            f"({pages} pages), {_size(arena.available_pages * arena.page_nbytes)} are free{line}{expect}; "
            "try again later or another server"
        )

    @staticmethod
    def _pages(parts: Iterable[Pool], pages_of) -> dict[PageArena, int]:
        """Pages one sequence needs of each arena, summed over ``parts`` (``pages_of(part)`` each)."""
        needed: dict[PageArena, int] = defaultdict(int)
        for part in parts:
            needed[part.arena] += pages_of(part)
        return needed

    def _parts_of(self, backends: Sequence[BlockBackend]) -> list[Pool]:
        return [part for backend in backends for part in self.parts[backend.uid]]

    def open_caches(
        self, backends: Sequence[BlockBackend], batch_size: int, max_length: int, lease: Lease | None = None
    ) -> list[SessionCache]:
        """A session's caches on ``backends``' pools (they take pages as the session grows, counted on
        ``lease``); none if one fails (``AllocationFailed`` where the pages went to older sessions)."""
        caches = lease.caches if lease is not None else []
        try:
            for backend in backends:
                caches.append(backend.open_cache(self.pools[backend.uid], batch_size, max_length, lease))
        except BaseException as error:
            for cache in caches:
                cache.release()
            if lease is not None:
                self.lender.end(lease)
            if isinstance(error, SessionPreempted):
                raise AllocationFailed(
                    f"not enough KV cache for this session's states now: {error}"
                ) from None
            raise
        return list(caches)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
