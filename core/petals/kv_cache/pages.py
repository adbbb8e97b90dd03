"""One block's attention cache memory: keys and values in fixed-size pages, shared by its sessions."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from petals.kv_cache.specs import FullAttentionSpec

PAGE_TOKENS = 16  # tokens per page: small enough to waste little, large enough to index cheaply


class CacheOverflowError(ValueError):
    """A step would write past the session's ``max_length``."""


class OutOfPagesError(RuntimeError):
    """The block's page pool has no free page left for a growing session."""


class PagePool:
    """One block's keys and values in ``num_pages`` pages of ``page_tokens`` tokens, shared by sessions.

    Keys and values have their own widths (``spec.key_dim``, ``spec.value_dim``). Pages are taken and
    given back under a lock: the compute thread takes them as sessions grow and gives a finished
    session's pages back; ``on_free`` callbacks (the server's admission) hear of pages given back.
    """

    def __init__(
        self,
        spec: FullAttentionSpec,
        num_pages: int,
        page_tokens: int = PAGE_TOKENS,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1 or page_tokens < 1:
            raise ValueError(f"a page pool needs pages and tokens per page, got {num_pages} × {page_tokens}")
        self.spec, self.num_pages, self.page_tokens = spec, num_pages, page_tokens
        slots = num_pages * page_tokens
        # empty, not zeros: only written slots are ever read, and on CPU untouched pages stay unmapped
        self.keys = torch.empty((slots, spec.num_kv_heads, spec.key_dim), dtype=dtype, device=device)
        self.values = torch.empty((slots, spec.num_kv_heads, spec.value_dim), dtype=dtype, device=device)
        self.lock = threading.RLock()
        self._free = list(range(num_pages - 1, -1, -1))  # taken from the end: low pages first
        self.on_free: list[Callable[[], None]] = []

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return self.free_pages * self.page_tokens

    @property
    def page_nbytes(self) -> int:
        return self.page_tokens * self.spec.bytes_per_token(self.keys.dtype)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-token tensor of the pool, slot by slot (what a beam reorder moves)."""
        return (self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    @property
    def unit(self) -> str:
        return f"pages of {self.page_tokens} tokens"

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def max_pages(self, length: int) -> int:
        """The most pages one sequence of ``length`` tokens ever holds: a kind that keeps only its last
        tokens (a sliding window) holds them from any offset in a page, so one page more than they fill."""
        held = self.spec.tokens_held(length)
        return self.pages_for(held) + (held < length)

    def take(self, count: int) -> list[int]:
        with self.lock:
            if count > len(self._free):
                raise OutOfPagesError(
                    f"the server's KV cache is full: {count} more pages of {self.page_tokens} tokens needed, "
                    f"{len(self._free)} free; try again later or another server"
                )
            pages = self._free[len(self._free) - count :]
            del self._free[len(self._free) - count :]
            return pages[::-1]  # ascending: a lone session's pages lie one after another

    def give_back(self, pages: Sequence[int]) -> None:
        if not pages:
            return
        with self.lock:
            self._free.extend(reversed(pages))
        for callback in self.on_free:
            callback()
