"""The key/value cache a server owns for one block of one inference session.

A ``BlockCache`` is a transformers ``Cache`` with a single layer whose key and value tensors are
allocated once, for the session's ``max_length``, and filled in place. Hugging Face decoder layers
call ``cache.update(key, value, layer_idx=0)`` exactly as inside the full model, so a standalone
block computes what the full model computes, while the server knows the cache's size up front.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class CacheOverflowError(ValueError):
    """A step would write past the session's ``max_length``."""


@dataclass(frozen=True)
class KVCacheLayout:
    """What one block caches per token: ``num_kv_heads`` keys and values of ``head_dim`` each.

    ``num_query_heads`` is how many heads the attention computes; when a layer hands the cache
    keys broadcast to all query heads (as some grouped-query layers do), the cache keeps one
    head per group and expands them again on read.
    """

    num_kv_heads: int
    head_dim: int
    num_query_heads: int

    def __post_init__(self) -> None:
        if min(self.num_kv_heads, self.head_dim, self.num_query_heads) <= 0:
            raise ValueError(f"invalid KV cache layout {self}")
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_query_heads} query heads do not split into {self.num_kv_heads} groups"
            )

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of keys plus values that one cached token of one block takes."""
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize


class PreallocatedLayer(CacheLayerMixin):
    """One block's keys and values, ``[batch, kv_heads, max_length, head_dim]``, filled in place."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        layout: KVCacheLayout,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (batch_size, layout.num_kv_heads, max_length, layout.head_dim)
        self.layout = layout
        self.max_length = max_length
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the tensors were allocated in ``__init__``."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        broadcast = key_states.shape[1] != self.layout.num_kv_heads
        key_states, value_states = self._grouped(key_states), self._grouped(value_states)
        end = self.length + key_states.shape[-2]
        if end > self.max_length:
            raise CacheOverflowError(
                f"Maximum length exceeded: {self.length} cached + {key_states.shape[-2]} new tokens "
                f"> max_length {self.max_length}"
            )
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if broadcast:  # hand back as many heads as the layer gave
            keys = keys.repeat_interleave(self.layout.group_size, dim=1)
            values = values.repeat_interleave(self.layout.group_size, dim=1)
        return keys, values

    def _grouped(self, states: torch.Tensor) -> torch.Tensor:
        if states.shape[1] == self.layout.num_kv_heads:
            return states
        if states.shape[1] != self.layout.num_query_heads:
            raise ValueError(
                f"the layer produced {states.shape[1]} key/value heads; the cache layout expects "
                f"{self.layout.num_kv_heads} (or {self.layout.num_query_heads} broadcast ones)"
            )
        return states[:, :: self.layout.group_size]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_length

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        beam_idx = beam_idx.to(self.keys.device)
        self.keys.copy_(self.keys.index_select(0, beam_idx))
        self.values.copy_(self.values.index_select(0, beam_idx))

    def reset(self) -> None:
        self.length = 0


class BlockCache(Cache):
    """The cache of one block in one session: preallocated, rewindable, reorderable for beams."""

    def __init__(
        self,
        layout: KVCacheLayout,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        layer = PreallocatedLayer(layout, batch_size, max_length, dtype, torch.device(device))
        super().__init__(layers=[layer])
        self.layout = layout
        self.num_sequences = batch_size
        self.max_length = max_length

    @property
    def layer(self) -> PreallocatedLayer:
        return self.layers[0]

    @property
    def position(self) -> int:
        """How many tokens are cached."""
        return self.layer.length

    @property
    def nbytes(self) -> int:
        return self.layer.keys.nbytes + self.layer.values.nbytes

    def rewind(self, position: int) -> None:
        """Forget every token from ``position`` on (the next step writes there)."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to position {position}: {self.position} tokens are cached")
        self.layer.length = position

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Reorder the batch (beam search): row ``i`` becomes old row ``hypo_ids[i]``."""
        if hypo_ids.shape != (self.num_sequences,):
            raise ValueError(f"hypo_ids must have shape ({self.num_sequences},), got {tuple(hypo_ids.shape)}")
        if hypo_ids.numel() and not (0 <= int(hypo_ids.min()) and int(hypo_ids.max()) < self.num_sequences):
            raise ValueError(f"hypo_ids must be in [0, {self.num_sequences}), got {hypo_ids.tolist()}")
        self.layer.reorder_cache(hypo_ids)
