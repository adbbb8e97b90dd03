"""The server's cache budget: a page pool per hosted block, and which sessions may start.

``--attn_cache_tokens`` is the number of tokens of keys and values the server keeps **per hosted
block**: each block gets a pool of ``attn_cache_tokens / page_tokens`` pages (one per
tensor-parallel shard), sized in bytes by the block's cache spec, which sessions take page by page
as they grow and give back when they rewind, slide past their window or end. ``max_length`` only
caps a session; it reserves nothing. A session is admitted when it could ever fit (what its kind
holds of ``max_length``: a sliding window holds at most its window) and its first step's pages are
free now, or as soon as a page is given back (pools wake admission; nothing polls); one that later
finds no free page fails alone with a clear error (``OutOfPagesError``), its neighbours' pages untouched.

What we announce follows Petals' unit: ``cache_tokens_left`` (and rpc_info's
``cache_tokens_available``) count keys and values separately and sum over blocks, i.e.
``2 × Σ free tokens`` of the blocks' pools; Petals clients check
``max_length × 2 × span_length <= cache_tokens_left``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from petals.kv_cache import PAGE_TOKENS, PagePool, SessionCache
from petals.server.backend import BlockBackend


class AllocationFailed(RuntimeError):
    """Not enough KV-cache memory for a session (now, or ever)."""


class CacheBudget:
    """The hosted blocks' page pools; admission is decided in the server's event loop."""

    def __init__(
        self, backends: Sequence[BlockBackend], tokens_per_block: int, page_tokens: int = PAGE_TOKENS
    ):
        page_tokens = max(1, min(page_tokens, tokens_per_block))
        num_pages = max(1, tokens_per_block // page_tokens)
        self.pools: dict[str, list[PagePool]] = {
            backend.uid: backend.make_pools(num_pages, page_tokens) for backend in backends
        }
        self.num_pages, self.page_tokens = num_pages, page_tokens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._freed = asyncio.Event()
        for pools in self.pools.values():
            for pool in pools:
                pool.on_free.append(self._pages_freed)

    def _pages_freed(self) -> None:
        """A pool gave pages back (in any thread): wake the sessions waiting for admission."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._freed.set)

    @property
    def tokens_left(self) -> int:
        """In Petals' unit (keys and values counted separately, summed over blocks)."""
        return 2 * sum(self._free_pages(uid) for uid in self.pools) * self.page_tokens

    @property
    def nbytes(self) -> int:
        """Bytes the pools take when full."""
        return sum(pool.nbytes for pools in self.pools.values() for pool in pools)

    @property
    def bytes_left(self) -> int:
        """Bytes of the pools' free pages."""
        return sum(pool.free_pages * pool.page_nbytes for pools in self.pools.values() for pool in pools)

    @property
    def bytes_used(self) -> int:
        return self.nbytes - self.bytes_left

    def _free_pages(self, uid: str) -> int:
        return min(pool.free_pages for pool in self.pools[uid])

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
        held = max(backend.tokens_held(max_length) for backend in backends)
        if -(-held // self.page_tokens) * batch_size > self.num_pages:
            raise AllocationFailed(
                f"this session needs {batch_size} × {held} tokens of KV cache per block but the server's "
                f"whole budget is {self.num_pages * self.page_tokens} tokens per block; use a smaller max_length "
                "or batch"
            )
        needed = -(-first_tokens // self.page_tokens) * batch_size
        deadline = time.monotonic() + timeout
        while True:
            self._freed.clear()  # before looking: a page given back after this wakes the wait below
            free = min(self._free_pages(backend.uid) for backend in backends)
            if free >= needed:
                return
            if (remaining := deadline - time.monotonic()) <= 0:
                raise AllocationFailed(
                    f"not enough KV cache: this session's first step needs {needed} pages of {self.page_tokens} "
                    f"tokens per block, {free} are free; try again later or another server"
                )
            try:
                await asyncio.wait_for(self._freed.wait(), remaining)
            except TimeoutError:
                pass

    def open_caches(
        self, backends: Sequence[BlockBackend], batch_size: int, max_length: int
    ) -> list[SessionCache]:
        """A session's caches on ``backends``' pools (they take pages as the session grows)."""
        return [backend.open_cache(self.pools[backend.uid], batch_size, max_length) for backend in backends]
