"""The server's KV-cache budget: how many bytes sessions may hold, and who holds what.

``--attn_cache_tokens`` is the number of tokens of keys and values the server keeps **per hosted
block**, so the budget is ``attn_cache_tokens × bytes_per_token × num_blocks`` bytes, where
``bytes_per_token`` is one block's keys plus values for one token (the family's KV layout, GQA
counted). A session of ``batch`` sequences reserving ``max_length`` tokens on ``n`` blocks takes
``batch × max_length × bytes_per_token × n`` bytes until it ends.

What we announce follows Petals' unit: ``cache_tokens_left`` (and rpc_info's
``cache_tokens_available``) count keys and values separately, i.e. ``bytes_left // (bytes_per_token / 2)``;
Petals clients check ``max_length × 2 × span_length <= cache_tokens_left``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AllocationFailed(RuntimeError):
    """Not enough KV-cache memory for a session (now, or ever)."""


class CacheBudget:
    """Byte accounting for KV caches, used from the server's event loop only."""

    def __init__(self, max_bytes: int, bytes_per_token: int) -> None:
        self.max_bytes = max_bytes
        self.bytes_per_token = bytes_per_token
        self.bytes_used = 0
        self._freed = asyncio.Condition()

    @property
    def bytes_left(self) -> int:
        return self.max_bytes - self.bytes_used

    @property
    def tokens_left(self) -> int:
        """In Petals' unit (keys and values counted separately, summed over blocks)."""
        return self.bytes_left * 2 // self.bytes_per_token

    def session_bytes(self, batch_size: int, max_length: int, num_blocks: int) -> int:
        return batch_size * max_length * self.bytes_per_token * num_blocks

    @asynccontextmanager
    async def reserve(self, nbytes: int, timeout: float = 0.0) -> AsyncIterator[None]:
        """Hold ``nbytes`` for the duration of the block, waiting up to ``timeout`` seconds for them."""
        if nbytes > self.max_bytes:
            raise AllocationFailed(
                f"this session needs {nbytes} bytes of KV cache but the server's whole budget is {self.max_bytes} "
                "bytes; use a smaller max_length or batch"
            )
        async with self._freed:
            if timeout > 0:
                try:
                    await asyncio.wait_for(self._freed.wait_for(lambda: nbytes <= self.bytes_left), timeout)
                except TimeoutError:
                    pass
            if nbytes > self.bytes_left:
                raise AllocationFailed(
                    f"not enough KV cache: this session needs {nbytes} bytes, {self.bytes_left} are free; "
                    "try again later or another server"
                )
            self.bytes_used += nbytes
        try:
            yield
        finally:
            self.bytes_used -= nbytes  # synchronously: a cancelled session must still give its bytes back
            asyncio.ensure_future(self._notify_freed())

    async def _notify_freed(self) -> None:
        async with self._freed:
            self._freed.notify_all()
