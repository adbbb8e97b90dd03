"""What serving Gemma 4 (text) block by block takes: refusing the two features a pipeline of
servers cannot run, and the cache of each layer, whose sizes differ by layer type.

Per-layer embeddings (``hidden_size_per_layer_input`` > 0: Gemma 4 E2B and E4B) feed every layer an
input the full model computes from the token ids before its first layer; KV sharing
(``num_kv_shared_layers`` > 0) makes the last layers attend with keys and values of earlier layers,
which other servers hold. Neither reaches a server: such configs are refused when loaded, in one line
naming the field to set to 0.

A full-attention layer may have wider heads than a sliding one (``global_head_dim``) and, with
``attention_k_eq_v``, fewer key/value heads (``num_global_key_value_heads``), which transformers keeps
in ``config.per_layer_config``. Core's default reads the model-wide number of key/value heads, so the
cache of a full layer is described here.
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
    "num_kv_shared_layers": "the last layers reuse keys and values of earlier layers, held by other servers",
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
    a sliding layer keeps its window."""
    from petals.kv_cache import FullAttentionSpec, SlidingWindowSpec  # torch: not on loading plugins

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
