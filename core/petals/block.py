"""What every server-side block shares: building it, its positions, masks and cache.

A family's block subclasses ``ServerBlockMixin`` and its Hugging Face decoder layer; it is built as
``XBlock(config, block_index)``, always with HF ``layer_idx=0`` so that it reads and writes the
single layer of its cache (``prepare_config`` narrows per-layer settings such as ``layer_types``
to the block's own layer). Its ``forward(hidden_states, cache=None)`` takes a
``PagedCache`` (one session's ``BlockCache`` or several sessions' merged), derives each row's
positions and padding from it, and calls the HF layer with exactly the arguments the full HF model
would pass for a left-padded batch.
"""

from __future__ import annotations

import copy
import threading
from typing import ClassVar

import torch
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from petals.kv_cache import BlockCache, KVCacheLayout, PagedCache

# per compute thread: what the previous block computed for its step, {name: (key, value)}
_STEP_VALUES = threading.local()


class ServerBlockMixin:
    """Mixed in front of an HF decoder layer class: ``class XBlock(ServerBlockMixin, XDecoderLayer)``."""

    # the attention implementation transformers chooses for this family's full model by default
    attn_implementation: ClassVar[str] = "sdpa"
    # likewise for mixture-of-experts layers (None: the family has no experts)
    experts_implementation: ClassVar[str | None] = None
    # the HF rotary embedding module the full model applies before its layers (None: no rotary)
    rotary_class: ClassVar[type[torch.nn.Module] | None] = None
    config: PretrainedConfig

    def __init__(self, config: PretrainedConfig, block_index: int = 0) -> None:
        config = self.prepare_config(config, block_index)
        super().__init__(config, layer_idx=0)
        self.config = config
        if self.rotary_class is not None:
            with torch.device("cpu"):  # inv_freq is computed, not loaded: never leave it on "meta"
                self.rotary_emb = self.rotary_class(config)
        self._config_key = (type(self), self.rotary_class, config.to_json_string(use_diff=False))
        # read once: config attribute access is slow, and steps ask per block
        self._sdpa_full_attention = config._attn_implementation == "sdpa" and not self.uses_sliding_window

    @classmethod
    def prepare_config(cls, config: PretrainedConfig, block_index: int) -> PretrainedConfig:
        """A copy of ``config`` for block ``block_index``, with the attention (and experts)
        implementation the full model would use and, where the config lists one type per layer
        (``layer_types``), only this block's type: it runs as layer 0 of its own cache."""
        config = copy.deepcopy(config)
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[block_index]]
        if getattr(config, "_attn_implementation", None) is None:
            config._attn_implementation = cls.attn_implementation
        if cls.experts_implementation and getattr(config, "_experts_implementation", None) is None:
            config._experts_implementation = cls.experts_implementation
        return config

    def position_ids(self, hidden_states: torch.Tensor, cache: PagedCache | None) -> torch.LongTensor:
        """``[batch, length]``: each row's positions (rows of a merged cache sit at different ones); the
        previous block's, when it ran the same rows at the same positions."""
        if cache is None:
            return torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        return self._step_value(
            "positions",
            hidden_states,
            cache,
            lambda: cache.position_ids(hidden_states.shape[1], hidden_states.device),
        )

    def rotary_embeddings(
        self, hidden_states: torch.Tensor, position_ids: torch.LongTensor, cache: PagedCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's ``(cos, sin)`` for these positions. A server runs its blocks one after
        another on the same rows at the same positions, so blocks with equal configs reuse the
        previous block's result (as the full model computes it once for all its layers)."""
        return self._step_value(
            "rotary", hidden_states, cache, lambda: self.rotary_emb(hidden_states, position_ids)
        )

    def _step_value(self, name: str, hidden_states: torch.Tensor, cache: PagedCache | None, compute, *key):
        """``compute()``, or what the previous block computed under ``name`` for the same step: the same
        rows at the same positions, in a block of the same class and config (``key`` adds the rest)."""
        if cache is None:
            return compute()
        key = (
            self._config_key,
            cache.row_positions(),
            hidden_states.shape[:2],
            hidden_states.dtype,
            hidden_states.device,
            key,
        )
        values = getattr(_STEP_VALUES, "values", None)
        if values is None:
            values = _STEP_VALUES.values = {}
        last = values.get(name)
        if last is not None and last[0] == key:
            return last[1]
        value = compute()
        values[name] = (key, value)
        return value

    @staticmethod
    def attention_mask(hidden_states: torch.Tensor, cache: PagedCache | None) -> torch.LongTensor:
        """``[batch, keys]``: 1 where a row has a key, 0 where a merged cache pads it (ALiBi counts it)."""
        if cache is None:
            return torch.ones(hidden_states.shape[:2], dtype=torch.long, device=hidden_states.device)
        return cache.attention_mask(hidden_states.shape[1], hidden_states.device)

    @property
    def uses_sliding_window(self) -> bool:
        """Whether this layer attends within a sliding window (per layer type, or model-wide)."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return layer_types[0] == "sliding_attention"
        return getattr(self.config, "sliding_window", None) is not None

    def causal_mask(
        self, hidden_states: torch.Tensor, cache: PagedCache | None, position_ids: torch.LongTensor, **kwargs
    ) -> torch.Tensor | None:
        """The mask the full model builds for this layer, with a merged cache's padding (None where sdpa's
        is_causal suffices)."""
        if not kwargs and self._needs_no_mask(hidden_states, cache):
            return None
        mask_function = create_sliding_window_causal_mask if self.uses_sliding_window else create_causal_mask
        return self._step_value(
            "mask",
            hidden_states,
            cache,
            lambda: mask_function(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=self.attention_mask(hidden_states, cache) if cache is not None else None,
                cache=cache,
                position_ids=position_ids,
                layer_idx=0 if cache is not None else None,
                **kwargs,
            ),
            tuple(sorted(kwargs.items())),
        )

    def _needs_no_mask(self, hidden_states: torch.Tensor, cache: PagedCache | None) -> bool:
        """One new token per row, no padding, full attention under sdpa: every cached key is attended,
        which is what transformers' own mask function decides too, after more work per block."""
        return (
            cache is not None
            and hidden_states.shape[1] == 1
            and self._sdpa_full_attention
            and cache.rows_aligned
        )


class RotaryBlockMixin(ServerBlockMixin):
    """For layers called the way transformers' rotary decoder models call them.

    ``class XBlock(RotaryBlockMixin, XDecoderLayer): rotary_class = XRotaryEmbedding`` is a whole
    block. Families with other calling conventions (ALiBi, tuple outputs) use ``ServerBlockMixin``
    and write their own ``forward``.
    """

    def forward(self, hidden_states: torch.Tensor, cache: PagedCache | None = None) -> torch.Tensor:
        position_ids = self.position_ids(hidden_states, cache)
        return super().forward(
            hidden_states,
            attention_mask=self.causal_mask(hidden_states, cache, position_ids),
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary_embeddings(hidden_states, position_ids, cache),
        )


def kv_cache_layout(config: PretrainedConfig) -> KVCacheLayout:
    """How many key/value heads of which size one block caches per token, from the config's attributes:
    ``num_attention_heads``, ``num_key_value_groups`` (query heads per key/value head) and ``head_dim``
    (or ``hidden_size // num_attention_heads``)."""
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return KVCacheLayout(
        num_kv_heads=num_heads // config.num_key_value_groups, head_dim=head_dim, num_query_heads=num_heads
    )


def make_block(config: PretrainedConfig, block_index: int = 0) -> torch.nn.Module:
    """Block ``block_index`` with fresh weights (wrap in ``torch.device("meta")`` to skip allocation)."""
    return config.block_class(config, block_index)


def allocate_cache(
    config: PretrainedConfig,
    batch_size: int,
    max_length: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> BlockCache:
    """A cache for one block of one session, sized by the family's KV layout."""
    return BlockCache(kv_cache_layout(config), batch_size, max_length, dtype, device)
