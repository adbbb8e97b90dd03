"""One block's attention cache memory: keys and values in pages of an arena, shared by its sessions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from petals.kv_cache.arena import OutOfPagesError, PageArena, field
from petals.kv_cache.specs import FullAttentionSpec

PAGE_TOKENS = 16  # tokens per page: small enough to waste little, large enough to index cheaply

__all__ = ["PAGE_TOKENS", "CacheOverflowError", "OutOfPagesError", "PagePool"]


class CacheOverflowError(ValueError):
    """A step would write past the session's ``max_length``."""


class PagePool:
    """One block's keys and values, ``page_tokens`` tokens to a page, in pages of an arena.

    Keys and values have their own widths (``spec.key_dim``, ``spec.value_dim``); a page holds
    ``page_tokens`` rows of one token each (its keys, then its values, then whatever else the kind
    keeps per token), so that each per-token tensor is indexed by slot (``page * page_tokens + offset``).
    On a server's arena (``arena``) the pool takes its pages from the free list every block shares,
    looking first at ``home`` and after the sequence's last page; alone (no arena) it has
    ``num_pages`` pages of ``page_tokens`` tokens of its own (tests, measurements, a standalone cache).
    Pages are taken and given back under the arena's lock; ``on_free`` callbacks hear of pages given back.
    """

    def __init__(
        self,
        spec: FullAttentionSpec,
        num_pages: int = 0,
        page_tokens: int = PAGE_TOKENS,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        arena: PageArena | None = None,
        home: int = 0,
    ) -> None:
        self.spec, self.dtype = spec, dtype
        row = self.row_nbytes(spec, dtype)
        if arena is None:
            if num_pages < 1 or page_tokens < 1:
                raise ValueError(
                    f"a page pool needs pages and tokens per page, got {num_pages} × {page_tokens}"
                )
            arena = PageArena(num_pages, page_tokens * row, device)
        self.arena, self.home = arena, home
        self.num_pages = arena.num_pages
        self.page_tokens, rows = arena.rows(row)
        self.lock = arena.lock
        self.pages_held = 0  # of the arena's pages, by this pool's sessions
        self.on_free = arena.on_free
        offset = 0
        tensors = []
        for shape in self.token_shapes(spec):
            tensors.append(field(rows, offset, dtype, shape))
            offset += tensors[-1][0].nbytes
        self.keys, self.values = tensors[:2]
        self._tensors = tuple(tensors)

    @classmethod
    def token_shapes(cls, spec: FullAttentionSpec) -> list[tuple[int, ...]]:
        """What one cached token of one sequence keeps, tensor by tensor: its keys, its values."""
        return [(spec.num_kv_heads, spec.key_dim), (spec.num_kv_heads, spec.value_dim)]

    @classmethod
    def row_nbytes(cls, spec: FullAttentionSpec, dtype: torch.dtype) -> int:
        """Bytes of one token's row of the pool."""
        return sum(torch.Size(shape).numel() for shape in cls.token_shapes(spec)) * dtype.itemsize

    @property
    def free_pages(self) -> int:
        return self.arena.free_pages

    @property
    def page_nbytes(self) -> int:
        return self.arena.page_nbytes

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-token tensor of the pool, slot by slot (what a beam reorder moves)."""
        return self._tensors

    @property
    def nbytes(self) -> int:
        """Bytes of the arena the pool's pages come from."""
        return self.arena.nbytes

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def max_pages(self, length: int) -> int:
        """The most pages one sequence of ``length`` tokens ever holds: a kind that keeps only its last
        tokens (a sliding window) holds them from any offset in a page, so one page more than they fill."""
        held = self.spec.tokens_held(length)
        return self.pages_for(held) + (held < length)

    def take(self, count: int, after: int | None = None) -> list[int]:
        """``count`` pages, the ones after page ``after`` if they are free (a sequence's pages then lie
        one after another), else the first free ones from the pool's home on."""
        near = self.home if after is None else after + 1
        with self.lock:
            pages = self.arena.take(count, near, f"pages of {self.page_tokens} tokens")
            self.pages_held += count
        return pages

    def give_back(self, pages: Sequence[int]) -> None:
        with self.lock:
            self.pages_held -= len(pages)
        self.arena.give_back(pages)
