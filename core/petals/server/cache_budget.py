"""The server's cache budget: a pool per hosted block, and which sessions may start.

``--attn_cache_tokens`` is the number of tokens of keys and values the server keeps **per hosted
block**: each block gets a pool of ``attn_cache_tokens / page_tokens`` pages (one per
tensor-parallel shard), sized in bytes by the block's cache spec, which sessions take page by page
as they grow and give back when they rewind, slide past their window or end. ``max_length`` only
caps a session; it reserves nothing. A session is admitted when it could ever fit (what its kind
holds of ``max_length``: a sliding window holds at most its window) and its first step's pages are
free now, or as soon as a page is given back (pools wake admission; nothing polls); one that later
finds no free page fails alone with a clear error (``OutOfPagesError``), its neighbours' pages untouched.

A linear-attention block keeps a fixed-size state per sequence instead (``StatePool``): its pool holds
one sequence per ``TOKENS_PER_SEQUENCE`` tokens of the budget, and a session takes one per sequence
when it opens, whatever its length; admission asks each pool what a sequence needs of it. A hybrid
block (attention and a state in one layer) has a pool of each, and admission asks both.

What we announce follows Petals' unit: ``cache_tokens_left`` (and rpc_info's
``cache_tokens_available``) count keys and values separately and sum over blocks, i.e.
``2 × Σ free tokens`` of the blocks' pools; Petals clients check
``max_length × 2 × span_length <= cache_tokens_left``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from petals.kv_cache import PAGE_TOKENS, HybridPool, PagePool, SessionCache, StatePool, pool_parts
from petals.server.backend import BlockBackend


class AllocationFailed(RuntimeError):
    """Not enough KV-cache memory for a session (now, or ever)."""


class CacheBudget:
    """The hosted blocks' pools; admission is decided in the server's event loop."""

    def __init__(
        self, backends: Sequence[BlockBackend], tokens_per_block: int, page_tokens: int = PAGE_TOKENS
    ):
        page_tokens = max(1, min(page_tokens, tokens_per_block))
        self.pools: dict[str, list[PagePool | StatePool | HybridPool]] = {
            backend.uid: backend.make_pools(tokens_per_block, page_tokens) for backend in backends
        }
        # what admission counts: each pool, or each part of a hybrid block's (its pages and its states)
        self.parts: dict[str, list[PagePool | StatePool]] = {
            uid: [part for pool in pools for part in pool_parts(pool)] for uid, pools in self.pools.items()
        }
        # what a block counts in tokens_left: its own parts; a block that reuses another's keys and
        # values has none, and a session's tokens there are held by its source's
        uids = {backend.index: backend.uid for backend in backends}
        self.counted = {
            backend.uid: self.parts[backend.uid]
            or self.parts.get(uids.get(backend.cache_spec.reads_from, ""), [])
            for backend in backends
        }
        self._loop: asyncio.AbstractEventLoop | None = None
        self._freed = asyncio.Event()
        for pools in self.parts.values():
            for pool in pools:
                pool.on_free.append(self._pages_freed)

    def _pages_freed(self) -> None:
        """A pool gave pages back (in any thread): wake the sessions waiting for admission."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._freed.set)

    @property
    def tokens_left(self) -> int:
        """In Petals' unit (keys and values counted separately, summed over blocks); a block of sequence
        states counts each free sequence as the tokens of the budget it stands for."""
        return 2 * sum(min(pool.free_tokens for pool in pools) for pools in self.counted.values() if pools)

    @property
    def nbytes(self) -> int:
        """Bytes the pools take when full."""
        return sum(pool.nbytes for pools in self.parts.values() for pool in pools)

    @property
    def bytes_left(self) -> int:
        """Bytes of the pools' free pages."""
        return sum(pool.free_pages * pool.page_nbytes for pools in self.parts.values() for pool in pools)

    @property
    def bytes_used(self) -> int:
        return self.nbytes - self.bytes_left

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
        for backend in backends:
            for pool in self.parts[backend.uid]:
                # the most it ever holds, or its first step, taken whole before a window drops anything
                held = max(backend.tokens_held(max_length), first_tokens)
                pages = max(pool.max_pages(max_length), pool.pages_for(first_tokens))
                if pages * batch_size > pool.num_pages:
                    raise AllocationFailed(
                        f"this session needs {batch_size} × {pages} {pool.unit} of cache in block "
                        f"{backend.index} ({batch_size} × {held} tokens) but the server's whole budget is "
                        f"{pool.num_pages}; use a smaller max_length or batch"
                    )
        deadline = time.monotonic() + timeout
        while True:
            self._freed.clear()  # before looking: a page given back after this wakes the wait below
            short = self._first_short(backends, batch_size, first_tokens)
            if short is None:
                return
            if (remaining := deadline - time.monotonic()) <= 0:
                raise AllocationFailed(
                    f"not enough KV cache: this session's first step needs {short}; try again later or another server"
                )
            try:
                await asyncio.wait_for(self._freed.wait(), remaining)
            except TimeoutError:
                pass

    def _first_short(
        self, backends: Sequence[BlockBackend], batch_size: int, first_tokens: int
    ) -> str | None:
        """What the first step of ``first_tokens`` tokens lacks now (None: nothing)."""
        for backend in backends:
            for pool in self.parts[backend.uid]:
                needed = pool.pages_for(first_tokens) * batch_size
                if pool.free_pages < needed:
                    return f"{needed} {pool.unit} in block {backend.index}, {pool.free_pages} are free"
        return None

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
