"""A server's cache memory on one device: pages of equal bytes, shared by every block's pool.

Each cache kind lays a page out its own way: an attention pool keeps so many tokens' keys and values
in it (as many as fit: ``page_tokens``), a state pool one sequence's state and snapshots. Because the
pages are the same size, one free list serves them all, and memory goes to whichever kind needs it: a
server whose sliding-window blocks hold little lends the rest to its full-attention blocks, and its
budget and admission count bytes (pages), not tokens of each block (as vLLM's hybrid allocator does).

Each pool has a home, an offset in the arena where it looks for pages first, and it asks for the page
after its sequence's last one: a lone session's pages then lie one after another in each block, which
lets attention read them as one slice, as it could when each block had a pool of its own. When a
pool's neighbourhood is full it takes free pages anywhere.

Pages held by idle or kept sessions are lent (``kept_pages``, counted by ``petals.kv_cache.lending``):
they count as available, and when a session needs more pages than are free, the arena asks its
``lender`` to make room (idle and kept pages first, then a preemption) before it refuses.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

ALIGN = 64  # bytes: a page size that every dtype's view and every field of a page can start on


class OutOfPagesError(RuntimeError):
    """The server's cache has no free page left for a growing session."""


class Lender(Protocol):
    """What an arena asks when a session needs more pages than are free (``petals.kv_cache.lending``)."""

    def make_room(self, arena: PageArena, count: int, lease: Any) -> None:
        """Free pages of ``arena`` until ``count`` are free, if it can (raising for ``lease`` if it is the
        one to give its pages up)."""


class PageArena:
    """``num_pages`` pages of ``page_nbytes`` bytes on ``device``, taken and given back under one lock
    (``lock``: one for all the arenas of a server, whose sessions span them); ``on_free`` callbacks (the
    server's admission) hear of pages given back, from any thread."""

    def __init__(
        self,
        num_pages: int,
        page_nbytes: int,
        device: torch.device | str = "cpu",
        *,
        lock: threading.RLock | None = None,
    ) -> None:
        if num_pages < 1 or page_nbytes < 1:
            raise ValueError(f"a cache arena needs pages and bytes per page, got {num_pages} × {page_nbytes}")
        self.num_pages, self.page_nbytes = num_pages, page_nbytes
        # empty, not zeros: only written slots are ever read, and on CPU untouched pages stay unmapped
        self.storage = torch.empty((num_pages, page_nbytes), dtype=torch.uint8, device=device)
        self.lock = lock or threading.RLock()
        self._free = bytearray(b"\x01") * num_pages  # 1: free
        self._free_count = num_pages
        self.kept_pages = 0  # held by idle or kept sessions: lent, given up whenever a session needs them
        self.lender: Lender | None = None
        self.on_free: list[Callable[[], None]] = []

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def free_pages(self) -> int:
        return self._free_count

    @property
    def available_pages(self) -> int:
        """Pages a new session may count on: the free ones and those idle or kept sessions lend."""
        return self._free_count + self.kept_pages

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_nbytes

    def make_room(self, count: int, lease: Any = None, what: str = "pages") -> None:
        """Have ``count`` pages free: ask the lender to free some if fewer are (for ``lease``'s session);
        raises ``OutOfPagesError`` if it cannot."""
        with self.lock:
            if count > self._free_count and self.lender is not None:
                self.lender.make_room(self, count, lease)
            if count > self._free_count:
                raise OutOfPagesError(
                    f"the server's KV cache is full: {count} more {what} needed, {self._free_count} "
                    f"pages of {self.page_nbytes} bytes free; try again later or another server"
                )

    def take(self, count: int, near: int = 0, what: str = "pages", lease: Any = None) -> list[int]:
        """``count`` free pages: the run starting at ``near`` if it is free, else the first free ones from
        ``near`` on (wrapping around); when fewer are free, room is made first (``make_room``), or
        ``OutOfPagesError`` raised, taking none."""
        with self.lock:
            self.make_room(count, lease, what)
            if count == 0:
                return []
            near = near % self.num_pages
            run = self._free[near : near + count]
            if len(run) == count and run.count(1) == count:
                pages = list(range(near, near + count))
            else:
                pages, start = [], near
                while len(pages) < count:
                    found = self._free.find(1, start)
                    if found < 0:
                        found = self._free.find(1)  # wrap around: there are enough free pages
                    pages.append(found)
                    start = found + 1
                    self._free[found] = 0  # so that the search moves on
            for page in pages:
                self._free[page] = 0
            self._free_count -= count
            return pages

    def give_back(self, pages: Sequence[int]) -> None:
        if not pages:
            return
        with self.lock:
            for page in pages:
                if self._free[page]:
                    raise RuntimeError(f"page {page} was given back twice")
                self._free[page] = 1
            self._free_count += len(pages)
        for callback in self.on_free:
            callback()

    def rows(self, row_nbytes: int) -> tuple[int, torch.Tensor]:
        """The arena seen as rows of at least ``row_nbytes`` bytes, a page holding a whole number of them:
        ``(rows per page, uint8 tensor [num_pages * rows per page, row stride])``."""
        if row_nbytes > self.page_nbytes:
            raise ValueError(f"a row of {row_nbytes} bytes does not fit a page of {self.page_nbytes}")
        per_page = rows_per_page(self.page_nbytes, row_nbytes)
        return per_page, self.storage.view(self.num_pages * per_page, self.page_nbytes // per_page)


def rows_per_page(page_nbytes: int, row_nbytes: int) -> int:
    """The most rows of ``row_nbytes`` bytes that a page holds, their stride dividing the page exactly
    and keeping each row's start aligned for its elements (a row wastes the few bytes left over)."""
    for count in range(page_nbytes // row_nbytes, 0, -1):
        if page_nbytes % count == 0 and (page_nbytes // count) % _alignment(row_nbytes) == 0:
            return count
    raise ValueError(f"a row of {row_nbytes} bytes does not fit a page of {page_nbytes}")


def _alignment(row_nbytes: int) -> int:
    """The element size a row of ``row_nbytes`` bytes must start on (the largest one that divides it)."""
    for size in (8, 4, 2):
        if row_nbytes % size == 0:
            return size
    return 1


def field(rows: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The ``[rows, *shape]`` tensor of ``dtype`` at byte ``offset`` of each of ``rows`` (uint8,
    ``[rows, stride]``): a view, written in place."""
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    return rows[:, offset : offset + nbytes].view(dtype).unflatten(1, tuple(shape))


def aligned(offset: int, size: int = 16) -> int:
    return -(-offset // size) * size


def page_nbytes_for(demands: Sequence[tuple[int, int]]) -> int:
    """The page size of an arena whose pools each need a page of at least so many bytes, in rows of so
    many bytes (``demands``: ``(bytes, row bytes)``): the largest, rounded up to a multiple of every
    attention row where that costs little (then each kind's rows fill a page exactly), else to ``ALIGN``."""
    largest = max((nbytes for nbytes, _ in demands), default=ALIGN)
    rows = {row for nbytes, row in demands if row < nbytes}  # a state is one row: any spare is its own
    multiple = math.lcm(ALIGN, *rows)
    if multiple <= 4 * largest:
        return -(-largest // multiple) * multiple
    return aligned(largest, ALIGN)
