"""What serving Gemma 4 (text) block by block takes: refusing the feature a pipeline of servers cannot
run yet, and the cache of each layer, whose sizes differ by layer type.

Per-layer embeddings (``hidden_size_per_layer_input`` > 0: Gemma 4 E2B and E4B) feed every layer an
input the full model computes from the token ids before its first layer, which no server has: such
configs are refused when loaded, in one line naming the field to set to 0.

A full-attention layer may have wider heads than a sliding one (``global_head_dim``) and, with
``attention_k_eq_v``, fewer key/value heads (``num_global_key_value_heads``), which transformers keeps
in ``config.per_layer_config``. Core's default reads the model-wide number of key/value heads, so the
cache of a full layer is described here. The last ``num_kv_shared_layers`` layers cache nothing: each
attends with the keys and values of the last earlier layer of its type (``SharedKVSpec``), which core
keeps on the same server and hands on within each pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from petals.plugins import PluginError

if TYPE_CHECKING:
    from transformers import Gemma4TextConfig

    from petals.kv_cache import CacheSpec

# config field -> why a server cannot run a model that sets it
UNSERVABLE = {
    "hidden_size_per_layer_input": "per-layer embeddings, computed from the token ids, feed every layer",
}


class UnservableConfigError(PluginError, ValueError):
    """A Gemma 4 config that blocks on separate servers cannot compute."""


def refuse_unservable(config: Gemma4TextConfig) -> None:
    """Raise one line naming the first field that a pipeline of servers cannot serve."""
    for field, reason in UNSERVABLE.items():
        value = getattr(config, field, 0)
        if value:
            raise UnservableConfigError(
                f"gemma4_text with {field}={value} cannot be served block by block ({reason}); "
                f"petals serves Gemma 4 configs with {field}=0"
            )


def cache_spec(config: Gemma4TextConfig, block_index: int) -> CacheSpec:
    """Keys and values of this layer's own heads: ``head_dim`` values each (``global_head_dim`` on full
    layers), ``num_key_value_heads`` of them (``num_global_key_value_heads`` on full layers where set);
    a sliding layer keeps its window; a layer that reuses another's keeps nothing."""
    from petals.kv_cache import FullAttentionSpec, SharedKVSpec, SlidingWindowSpec, kv_source

    source = kv_source(config, block_index)  # torch above: not on loading plugins
    if source is not None:
        return SharedKVSpec(source, cache_spec(config, source))
    layer = config.per_layer_config[block_index]
    sizes = dict(
        num_kv_heads=layer.num_key_value_heads,
        key_dim=layer.head_dim,
        value_dim=layer.head_dim,
        num_query_heads=config.num_attention_heads,
    )
    # the config always lists its layer types (core's reading walks every layer's config, for each call)
    if config.layer_types[block_index] == "sliding_attention":
        return SlidingWindowSpec(**sizes, window=config.sliding_window)
    return FullAttentionSpec(**sizes)
