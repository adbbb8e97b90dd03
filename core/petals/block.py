"""What every server-side block shares: building it, its positions, masks and cache.

A family's block subclasses ``ServerBlockMixin`` and its Hugging Face decoder layer; it is built as
``XBlock(config, block_index)``, with HF ``layer_idx=block_index``: it is the full model's layer of
that index (dense MLP or experts, rope or no rope, sliding or full attention), and the cache it is
given answers for that index. Its ``forward(hidden_states, cache=None)`` takes a ``PagedCache``
(one session's or several sessions' merged), derives each row's positions and padding from it, and
calls the HF layer with exactly the arguments the full HF model would pass for a left-padded batch,
with the attention (and experts) implementation transformers picks for the full model.

What a block caches is its ``cache_spec`` (the hook of that name; core's default reads
transformers' own kind for the layer and the config's sizes).
"""

from __future__ import annotations

import copy
import inspect
import threading
from typing import ClassVar

import torch
from transformers import PretrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)

from petals.kv_cache import CacheSpec, PagedCache, RowsCache, SessionCache, open_cache
from petals.kv_cache.specs import kv_source, layer_kind

# per compute thread: what the previous block computed for its step, {name: (key, value)}
_STEP_VALUES = threading.local()
_MASK_FUNCTIONS = {
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
    "linear_attention": create_recurrent_attention_mask,  # padding rows only: a state has no positions
    "conv": create_recurrent_attention_mask,  # a short convolution's state has no positions either
}
_WINDOWED = ("sliding_attention", "chunked_attention")


class ServerBlockMixin:
    """Mixed in front of an HF decoder layer class: ``class XBlock(ServerBlockMixin, XDecoderLayer)``."""

    # the attention / experts implementation to force (None: what transformers picks for the full model)
    attn_implementation: ClassVar[str | None] = None
    experts_implementation: ClassVar[str | None] = None
    # the HF rotary embedding module the full model applies before its layers (None: no rotary)
    rotary_class: ClassVar[type[torch.nn.Module] | None] = None
    config: PretrainedConfig

    def __init__(self, config: PretrainedConfig, block_index: int = 0) -> None:
        config = self.prepare_config(config, block_index)
        super().__init__(
            config, layer_idx=block_index, **_layer_type_argument(super().__init__, config, block_index)
        )
        self.config, self.block_index = config, block_index
        self.layer_type = layer_type(config, block_index)
        if self.rotary_class is not None:
            with torch.device("cpu"):  # inv_freq is computed, not loaded: never leave it on "meta"
                self.rotary_emb = self.rotary_class(config)
        # the full model calls some rotary embeddings with the layer's type (one (cos, sin) per type), and
        # hands a layer of a type the embedding has no rope for none (the layer attends without positions)
        self._rotary_layer_type = (
            {"layer_type": self.layer_type}
            if self.rotary_class is not None and _takes_layer_type(self.rotary_class)
            else {}
        )
        rope_types = getattr(getattr(self, "rotary_emb", None), "rope_type", None)
        self._without_rope = (
            isinstance(rope_types, dict) and self._rotary_layer_type and self.layer_type not in rope_types
        )
        self._config_key = (type(self), self.rotary_class, self.layer_type, _config_json(config))
        # read once: config attribute access is slow, and steps ask per block
        self._sdpa_full_attention = config._attn_implementation == "sdpa" and not self.uses_sliding_window
        # a layer that stores or reuses keys and values shared in one pass takes them as transformers'
        # model hands them on: one dict, ``shared_kv_states``, from layer to layer (``shared_kv_kwargs``)
        self.takes_shared_kv_states = "shared_kv_states" in inspect.signature(super().forward).parameters

    def __call__(self, hidden_states: torch.Tensor, cache: RowsCache | None = None, *args, **kwargs):
        """The block's forward; then the cache hears the step is done (``RowsCache.finish_step``: a kind
        that keeps a state the layer may have updated in place, a convolution's inputs or a state-space
        recurrence, stores it for the step's tokens)."""
        output = super().__call__(hidden_states, cache, *args, **kwargs)
        if cache is not None:
            cache.finish_step(hidden_states.shape[1])
        return output

    @classmethod
    def prepare_config(cls, config: PretrainedConfig, block_index: int) -> PretrainedConfig:
        """A copy of ``config`` for block ``block_index`` with the attention and experts implementations
        the full model would use (transformers' choice for the model class, unless the block forces one)."""
        config = copy.deepcopy(config)
        attention, experts = full_model_implementations(config)
        if getattr(config, "_attn_implementation", None) is None:
            config._attn_implementation = cls.attn_implementation or attention
        if getattr(config, "_experts_implementation", None) is None:
            config._experts_implementation = cls.experts_implementation or experts
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
        if self._without_rope:
            return None
        return self._step_value(
            "rotary",
            hidden_states,
            cache,
            lambda: self.rotary_emb(hidden_states, position_ids, **self._rotary_layer_type),
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
        """Whether this layer attends within a window (sliding or chunked), not to every earlier token."""
        return self.layer_type in _WINDOWED

    def causal_mask(
        self, hidden_states: torch.Tensor, cache: PagedCache | None, position_ids: torch.LongTensor, **kwargs
    ) -> torch.Tensor | None:
        """The mask the full model builds for this layer, with a merged cache's padding (None where sdpa's
        is_causal suffices)."""
        if self.layer_type == "dummy" or not kwargs and self._needs_no_mask(hidden_states, cache):
            return None  # a feed-forward layer (transformers' "dummy" cache kind) attends nothing
        mask_function = _MASK_FUNCTIONS.get(self.layer_type, create_causal_mask)
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
                layer_idx=self.block_index if cache is not None else None,
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

    def forward(
        self, hidden_states: torch.Tensor, cache: PagedCache | None = None, **layer_kwargs
    ) -> torch.Tensor:
        """``layer_kwargs``: what core hands on between the blocks of one pass (``shared_kv_kwargs``)."""
        position_ids = self.position_ids(hidden_states, cache)
        if self.rotary_class is not None:  # a model without rotary embeddings hands its layers none
            layer_kwargs["position_embeddings"] = self.rotary_embeddings(hidden_states, position_ids, cache)
        return super().forward(
            hidden_states,
            attention_mask=self.causal_mask(hidden_states, cache, position_ids),
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            **layer_kwargs,
        )


def shared_kv_kwargs(module: torch.nn.Module, shared: dict | None) -> dict:
    """What a block's call adds for the keys and values layers of one pass share: ``shared_kv_states``
    (``shared``: one dict per pass over a span, handed to each of its blocks in order; None: this block
    runs alone) where the block's layer takes it, else nothing."""
    if not getattr(module, "takes_shared_kv_states", False):
        return {}
    return {"shared_kv_states": {} if shared is None else shared}


# what transformers' model loops read off each layer to pick the mask they hand it
_MASK_CHOOSING_ATTRIBUTES = ("attention_type", "block_type")


class LayerListStandIn(torch.nn.Module):
    """A module a client or the kit puts in a transformers model's layer list in place of all its layers
    (``layer_list_config()``: the model's config). Where the model's loop reads a layer's type off it to
    choose the mask it hands the layer, it answers with the first layer's: the stand-in ignores masks."""

    def layer_list_config(self) -> PretrainedConfig:
        raise NotImplementedError

    def __getattr__(self, name: str):
        if name not in _MASK_CHOOSING_ATTRIBUTES:
            return super().__getattr__(name)
        layer_types = getattr(self.layer_list_config(), "layer_types", None)
        return layer_types[0] if layer_types else "full_attention"


def layer_type(config: PretrainedConfig, block_index: int) -> str:
    """The kind of layer ``block_index`` is, as transformers names it (``full_attention``,
    ``sliding_attention``, ``chunked_attention``, ``linear_attention``, ...); a layer that reuses an
    earlier layer's keys and values attends as its type says (transformers' cache calls it "dummy")."""
    if kv_source(config, block_index) is not None:
        return config.layer_types[block_index]
    return layer_kind(config, block_index)[0]


def closed_boundaries(config: PretrainedConfig) -> frozenset[int]:
    """Where no span of the model's blocks may begin or end: between a layer and a later one that
    reuses its keys and values (``petals.kv_cache.closed_boundaries`` over every block's spec)."""
    from petals.kv_cache import closed_boundaries as closed_between

    return closed_between([cache_spec(config, index) for index in range(config.num_hidden_layers)])


def cache_spec(config: PretrainedConfig, block_index: int) -> CacheSpec:
    """What block ``block_index`` caches: the family's ``cache_spec`` hook (or core's default)."""
    from petals.plugins import get_plugin_manager

    return get_plugin_manager().family_hooks(config).cache_spec(config=config, block_index=block_index)


def full_model_implementations(config: PretrainedConfig) -> tuple[str, str]:
    """The attention and experts implementations transformers picks for the full causal-LM model of
    ``config`` when none is asked for (GPT-OSS: eager attention, for its sinks; most: sdpa)."""
    if config.model_type not in _IMPLEMENTATIONS:
        _IMPLEMENTATIONS[config.model_type] = _ask_model_class(config)
    return _IMPLEMENTATIONS[config.model_type]


_IMPLEMENTATIONS: dict[str, tuple[str, str]] = {}


def _ask_model_class(config: PretrainedConfig) -> tuple[str, str]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    model_class = getattr(transformers, name, None) if name else None
    if model_class is None:
        return "sdpa", "eager"
    # the model class's own choice, read without building a model: it consults only the class and its config
    model = model_class.__new__(model_class)
    model.config = config
    attention = model_class.get_correct_attn_implementation(model, None, is_init_check=True)
    experts = model_class.get_correct_experts_implementation(model, None)
    return attention, experts


def _layer_type_argument(init, config: PretrainedConfig, block_index: int) -> dict:
    """``layer_type`` for a decoder layer that is told its type when built (its model passes it), rather
    than reading it from the config."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or "layer_type" not in inspect.signature(init).parameters:
        return {}
    return {"layer_type": layer_types[block_index]}


def _takes_layer_type(rotary_class: type) -> bool:
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def _config_json(config: PretrainedConfig) -> str:
    return config.to_json_string(use_diff=False)


def make_block(config: PretrainedConfig, block_index: int = 0) -> torch.nn.Module:
    """Block ``block_index`` with fresh weights (wrap in ``torch.device("meta")`` to skip allocation)."""
    return block_class_of(config, block_index)(config, block_index)


def block_class_of(config: PretrainedConfig, block_index: int) -> type[torch.nn.Module]:
    """The block class of layer ``block_index``: the one ``block_classes`` names for the layer's
    ``layer_types`` value, as transformers picks the decoder-layer class by it, else ``block_class``."""
    by_type = getattr(config, "block_classes", None)
    layer_types = getattr(config, "layer_types", None)
    if by_type and layer_types is not None and layer_types[block_index] in by_type:
        return by_type[layer_types[block_index]]
    return config.block_class


def allocate_cache(
    config: PretrainedConfig,
    batch_size: int,
    max_length: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    block_index: int = 0,
) -> SessionCache:
    """A standalone cache for block ``block_index`` of one session, holding all of ``max_length`` up front."""
    spec = cache_spec(config, block_index)
    return open_cache(spec, batch_size, max_length, dtype, device, layer_index=block_index)
