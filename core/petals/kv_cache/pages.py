"""One block's attention cache memory: keys and values in pages of an arena, shared by its sessions."""

from __future__ import annotations

import torch

from petals.kv_cache.arena import OutOfPagesError, PageArena, field
from petals.kv_cache.base import CacheOverflowError, Pool
from petals.kv_cache.specs import FullAttentionSpec

PAGE_TOKENS = 16  # tokens per page: small enough to waste little, large enough to index cheaply

__all__ = ["PAGE_TOKENS", "CacheOverflowError", "OutOfPagesError", "PagePool"]


class PagePool(Pool):
    """One block's keys and values, ``page_tokens`` tokens to a page, in pages of an arena.

    Keys and values have their own widths (``spec.key_dim``, ``spec.value_dim``); a page holds
    ``page_tokens`` rows of one token each (its keys, then its values, then whatever else the kind
    keeps per token), so that each per-token tensor is indexed by slot (``page * page_tokens + offset``).
    On a server's arena (``arena``) the pool takes its pages from the free list every block shares,
    looking first at ``home`` and after the sequence's last page; alone (no arena) it has
    ``num_pages`` pages of ``page_tokens`` tokens of its own (tests, measurements, a standalone cache).
    """

    spec: FullAttentionSpec

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
        row = self.row_nbytes(spec, dtype)
        if arena is None:
            if num_pages < 1 or page_tokens < 1:
                raise ValueError(
                    f"a page pool needs pages and tokens per page, got {num_pages} × {page_tokens}"
                )
            arena = PageArena(num_pages, page_tokens * row, device)
        page_tokens, rows = arena.rows(row)
        super().__init__(spec, arena, page_tokens, home)
        self.dtype = dtype
        self.unit = f"pages of {page_tokens} tokens"
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

    @classmethod
    def page_demand(
        cls, spec: FullAttentionSpec, dtype: torch.dtype, page_tokens: int
    ) -> tuple[tuple[int, int], ...]:
        """A page of ``page_tokens`` tokens, one token a row."""
        row = cls.row_nbytes(spec, dtype)
        return ((page_tokens * row, row),)

    @classmethod
    def for_budget(
        cls,
        spec: FullAttentionSpec,
        tokens: int,
        page_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagePool:
        return cls(spec, max(1, tokens // page_tokens), page_tokens, dtype, device)

    @classmethod
    def for_session(
        cls,
        spec: FullAttentionSpec,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagePool:
        """One page per sequence, or small pages for a kind that gives back what it no longer needs."""
        page_tokens = max_length if spec.tokens_held(max_length) >= max_length else PAGE_TOKENS
        pages = max(batch_size, 1) * -(-max_length // page_tokens)
        return cls(spec, pages, page_tokens, dtype, device)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-token tensor of the pool, slot by slot (what a beam reorder moves)."""
        return self._tensors
