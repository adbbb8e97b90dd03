"""The manager of indexed attention: full attention beside a sparse-attention indexer.

A sparse-attention layer (transformers' ``indexed_attention`` kind) caches, per token, what
its attention hands ``cache.update`` (keys and values; a latent and a rope key for latent attention)
and, through ``cache.update_indexer``, one key of its indexer (``IndexedAttentionSpec.index_dim``
values), which scores every cached token to choose those each query attends. Both live in the same
pages of one pool (``IndexedPagePool``): a sequence's page holds its keys, values and indexer keys of
the same tokens, so growing, rewinding, sliding and releasing need nothing of their own, and a beam
reorder moves every per-token tensor of the pool.

The layer calls ``update`` first, then ``update_indexer`` with the same tokens: the indexer keys are
written beside the keys the step just wrote, and handed back as the keys were (every row's visible
tokens, right-aligned and left-padded with zeros, which the layer's mask hides from its top-k).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from petals.kv_cache.attention import AttentionCache, PagedCache, PagedLayer
from petals.kv_cache.pages import PagePool
from petals.kv_cache.specs import IndexedAttentionSpec


class IndexedPagePool(PagePool):
    """A ``PagePool`` that also keeps one indexer key of ``spec.index_dim`` values per token slot."""

    spec: IndexedAttentionSpec

    @classmethod
    def token_shapes(cls, spec: IndexedAttentionSpec) -> list[tuple[int, ...]]:
        return [*super().token_shapes(spec), (spec.index_dim,)]

    @property
    def index_keys(self) -> torch.Tensor:
        return self.tensors[2]


class IndexedAttentionCache(AttentionCache):
    """One session's indexed-attention cache of one block: its keys, values and indexer keys in pages."""

    pool_class = IndexedPagePool
    serves = (IndexedAttentionSpec,)

    @staticmethod
    def merged(caches: Sequence[IndexedAttentionCache]) -> IndexedPagedCache:
        return IndexedPagedCache(caches)


class IndexedPagedLayer(PagedLayer):
    """The cache layer of an indexed-attention block: ``update`` as a ``PagedLayer``'s, and
    ``update_indexer`` for the same step's indexer keys."""

    pool: IndexedPagePool

    def __init__(self, members: Sequence[IndexedAttentionCache]) -> None:
        super().__init__(members)
        self.step_tokens: int | None = None  # tokens the step's update wrote

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.step_tokens = key_states.shape[-2]
        return keys, values

    def update_indexer(self, indexer_keys: torch.Tensor) -> torch.Tensor:
        """Write the step's indexer keys ``[rows, new tokens, index_dim]`` beside the keys its ``update``
        wrote; return every row's visible indexer keys ``[rows, tokens, index_dim]``, as ``update``
        returned its keys."""
        new_tokens, width = indexer_keys.shape[1], indexer_keys.shape[-1]
        if width != self.pool.spec.index_dim:
            raise ValueError(
                f"the layer produced indexer keys of {width} values; its cache spec says "
                f"{self.pool.spec.index_dim}: fix the family's cache_spec"
            )
        if new_tokens != self.step_tokens:
            raise ValueError(
                f"update_indexer got {new_tokens} tokens after an update of {self.step_tokens}: an indexed "
                "layer writes its keys and values first, then the same tokens' indexer keys"
            )
        self.write((self.pool.index_keys,), (indexer_keys,), back=new_tokens)
        return self.read((self.pool.index_keys,), self._visible_width())[0]


class IndexedPagedCache(PagedCache):
    """Several sessions' indexed-attention caches of one block, for one forward (their rows, in order)."""

    def __init__(self, members: Sequence[IndexedAttentionCache]) -> None:
        super().__init__(members, IndexedPagedLayer(members))

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if layer_idx != self.layer_index:
            raise ValueError(
                f"layer {layer_idx} wrote indexer keys into the cache of block {self.layer_index}"
            )
        return self.layer.update_indexer(indexer_keys)
