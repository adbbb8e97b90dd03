"""The plugin contract of petals-core: hook specifications only.

A model-family plugin is a module registered under the ``petals`` entry-point group that
implements some of these hooks with ``@petals.hookimpl``. Core registers its own defaults
(``petals.default_hooks``) through the very same hooks, marked ``trylast`` so that any family
answering a hook wins over them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from petals.kv_cache import KVCacheLayout

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
def block_class(config: PretrainedConfig) -> type[torch.nn.Module] | None:
    """Return the server-side block class for ``config``, or None if this plugin does not serve it.

    A block is one decoder layer that runs standalone: ``block(hidden_states [B, T, H],
    cache: petals.kv_cache.PagedCache | None) -> hidden_states``. The cache may hold rows of
    several sessions at different positions (left-padded): the block takes each row's positions
    and padding from ``cache.position_ids`` / ``cache.attention_mask`` (``ServerBlockMixin`` does)
    and computes exactly what the Hugging Face layer computes inside the full model.
    Core's default returns ``config.block_class``.
    """


@hookspec(firstresult=True)
def kv_cache_layout(config: PretrainedConfig) -> KVCacheLayout | None:
    """Return how many key/value heads of which size one block caches per token.

    The server budgets its cache memory with ``layout.bytes_per_token(dtype)``, so this must equal
    what the block really stores (GQA and multi-query count). Core's default derives it from
    ``num_attention_heads``, ``num_key_value_groups`` and ``head_dim``/``hidden_size``.
    """


@hookspec(firstresult=True)
def dht_prefix(model_id: str, config: PretrainedConfig) -> str | None:
    """Return the DHT key prefix for a model, or None to leave it to other plugins.

    ``model_id`` is a Hugging Face repo id (``org/name``) or, for a local directory, the folder
    name. Families reproduce the original Petals rules byte for byte so that mixed swarms meet on
    the same keys. Core's default: the last path part with ``.`` replaced by ``-``.
    """


@hookspec(firstresult=True)
def convert_block_state_dict(
    config: PretrainedConfig, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Convert one block's checkpoint tensors (prefix already stripped) to the block's own names.

    Needed where the on-disk layout differs from the in-memory module (e.g. per-expert
    weights on disk versus transformers 5's fused experts in memory). Core's default returns ``state_dict`` unchanged.
    """


@hookspec(firstresult=True)
def quantize_module(
    config: PretrainedConfig,
    module: torch.nn.Module,
    quantize_linear: Callable[[torch.nn.Linear], torch.nn.Module],
) -> torch.nn.Module | None:
    """Return a quantized replacement for a block submodule whose weights are not ``nn.Linear``.

    ``petals.convert.quantize_block`` walks the block: every ``nn.Linear`` is replaced by
    ``quantize_linear(linear)`` (a bitsandbytes int8 or nf4 layer, weights still on CPU); every
    other submodule is first offered to this hook. Return a module computing the same function
    whose weights went through ``quantize_linear`` (e.g. fused 3-D expert tensors rebuilt as one
    quantized linear per expert), or None to let core descend into ``module``'s children.
    ``config`` is the block's config. Core's default returns None, so weights outside
    ``nn.Linear`` stay unquantized.
    """


@hookspec(firstresult=True)
def tensor_parallel_config(config: PretrainedConfig, world_size: int) -> Any | None:
    """Return the ``tensor_parallel.Config`` that shards one block of ``config`` over ``world_size`` shards.

    Used by ``petals.convert.make_tensor_parallel``. The plan must shard attention by whole
    key/value groups (so each shard keeps its own KV cache of ``num_kv_heads / world_size`` heads,
    or all key/value heads where there is a single shared one), split MLPs (and experts) by
    columns then rows, and sum the row-parallel outputs with ``output_rules``; ``attr_rules`` fix
    per-shard head counts where the layer reads them. It must not touch KV caches: each shard is
    called with its own ``BlockCache``. Return None for configs this plugin does not serve; core
    has no default and reports that the family does not support tensor parallelism.
    """


def hook_names() -> list[str]:
    """Names of every hook in this contract (used by the docs meta-test and ``petals plugins``)."""
    return sorted(name for name, value in globals().items() if _is_hookspec(value))


def _is_hookspec(value: Any) -> bool:
    return callable(value) and hasattr(value, "petals_spec")
