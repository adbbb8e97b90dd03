"""The plugin contract of petals-core: hook specifications only.

A model-family plugin is a module registered under the ``petals`` entry-point group that
implements some of these hooks with ``@petals.hookimpl``. Core registers its own defaults
(``petals.default_hooks``) through the very same hooks, marked ``trylast`` so that any family
answering a hook wins over them. Every hook but ``register_model_families`` is called only on the
plugin that registered the config's model type (and core's defaults), so an implementation answers
for its own families and needs no check of which config it got.

What a family declares on its config class instead of through hooks: ``block_class`` (the block;
``block_classes`` per layer type where transformers builds layers of several classes), ``attn_class`` (its attention, which core's default cache description reads sizes from),
``block_prefix`` and ``num_key_value_groups``; checkpoint key conversion is transformers' own mapping
for the model type (``transformers.conversion_mapping``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from petals.kv_cache import CacheSpec


hookspec = pluggy.HookspecMarker("petals")
hookimpl = pluggy.HookimplMarker("petals")


@hookspec
def register_model_families(register: Callable[[type], None]) -> None:
    """Register the Distributed*Config classes this plugin serves.

    Call ``register(config_class)`` once per family; ``config_class.model_type`` (the Hugging Face
    ``model_type`` of ``config.json``) is the key clients and servers dispatch on. Two plugins
    registering the same model type is an error that names both.
    """


@hookspec(firstresult=True)
def dht_prefix(model_id: str, config: PretrainedConfig) -> str | None:
    """Return the DHT key prefix for a model (None: core's default).

    ``model_id`` is a Hugging Face repo id (``org/name``) or, for a local directory, the folder
    name. Families reproduce the original Petals rules byte for byte so that mixed swarms meet on
    the same keys. Core's default: the last path part with ``.`` replaced by ``-``.
    """


@hookspec(firstresult=True)
def cache_spec(config: PretrainedConfig, block_index: int) -> CacheSpec | None:
    """Return what block ``block_index`` caches per session: a spec from ``petals.kv_cache.specs``.

    Core's default reads the layer's kind from transformers (``get_layer_types_and_kwargs``: full,
    sliding or chunked attention, linear attention, ...) and its sizes from the config (key/value
    heads ``num_attention_heads // num_key_value_groups``; key and value widths ``qk_head_dim`` /
    ``v_head_dim`` / ``head_dim``), or from the config's ``attn_class`` where it has ``k_proj`` and
    ``v_proj``, or a multi-head latent attention's ``kv_a_proj_with_mqa`` (its latent and rope key:
    ``petals.kv_cache.specs.latent_widths``); the state of a linear-attention, convolution or hybrid
    layer from the block itself (``petals.kv_cache.specs.measured_state``); nothing for a feed-forward
    layer listed among the layer types (``StatelessSpec``). Implement it only where a layer caches something else
    than what its transformers layer hands the cache, or where its sizes differ by layer in a way the
    default does not read.
    Servers budget memory with it, and the kit checks it against what a block really caches.
    """


@hookspec(firstresult=True)
def quantize_module(
    config: PretrainedConfig,
    module: torch.nn.Module,
    quantize_linear: Callable[[torch.nn.Linear], torch.nn.Module],
) -> torch.nn.Module | None:
    """Return a replacement for a block submodule that the family quantizes its own way (or keeps as it is).

    ``petals.convert.quantize_block`` walks the block: every ``nn.Linear`` is replaced by
    ``quantize_linear(linear)`` (a bitsandbytes int8 or nf4 layer, weights still on CPU), every 3-D
    weight (fused experts) by a packed weight quantized one expert at a time; every other submodule is
    first offered to this hook. Return a module computing the same function (``module`` itself keeps
    it unquantized), or None to let core quantize it and descend into its children. ``config`` is the
    block's config. Core's default returns None: core quantizes every matrix of every first-party
    family, so none of them implements this hook.
    """


@hookspec(firstresult=True)
def tensor_parallel_config(config: PretrainedConfig, world_size: int) -> Any | None:
    """Return the ``tensor_parallel.Config`` that shards one block of ``config`` over ``world_size`` shards.

    Used by ``petals.convert.make_tensor_parallel``. The plan must shard attention by whole
    key/value groups (so each shard keeps its own KV cache of ``num_kv_heads / world_size`` heads,
    or all key/value heads where there is a single shared one), split MLPs (and experts) by
    columns then rows, and sum the row-parallel outputs with ``output_rules``; ``attr_rules`` fix
    per-shard head counts where the layer reads them. It must not touch KV caches: each shard is
    called with its own session cache. Core has no default: a family that does not implement it
    is reported as not supporting tensor parallelism.
    """


def hook_names() -> list[str]:
    """Names of every hook in this contract (the docs meta-tests in ``tests/test_hook_docs.py`` check each)."""
    return sorted(name for name, value in globals().items() if _is_hookspec(value))


def _is_hookspec(value: Any) -> bool:
    return callable(value) and hasattr(value, "petals_spec")
