"""Entry point of the DeepSeek plugin: registration and the one hook this family needs, ``cache_spec``.

DeepSeek's multi-head latent attention hands its cache the compressed latent (``kv_lora_rank``
values) and one rope key shared by all heads (``qk_rope_head_dim`` values), and expands them into
per-head keys and values only after reading the cache. Core's default would size the cache from the
expanded heads: for DeepSeek V3, 128 heads x (192 key + 128 value) = 40,960 values per token, where
the layer really keeps 512 + 64 = 576, about 71 times less. This hook describes what it keeps, so
that servers budget, and clients are routed, by the real size. The dht_prefix is core's default
("deepseek-ai/DeepSeek-V3" -> "DeepSeek-V3"): Petals had no DeepSeek rule to reproduce.

Kimi Linear's latent attention layers cache the same latent and rope key; its Kimi Delta Attention
layers keep, per sequence, the last ``linear_conv_kernel_dim`` inputs of a short convolution over their
queries, keys and values (``linear_num_heads x linear_head_dim`` each) and a float32
``linear_head_dim x linear_head_dim`` state per head: a fixed-size state, whatever the length.
"""

from petals import hookimpl
from petals_deepseek.config import (
    DistributedDeepseekV2Config,
    DistributedDeepseekV3Config,
    DistributedKimiLinearConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedDeepseekV3Config)
    register(DistributedDeepseekV2Config)
    register(DistributedKimiLinearConfig)


@hookimpl
def cache_spec(config, block_index: int):
    """One key/value "head" per token: the latent as its key, the shared rope key as its value (the
    two tensors the layer hands ``cache.update``), read by all query heads; Kimi Linear's delta
    attention layers: their state."""
    from petals.kv_cache import FullAttentionSpec, LinearAttentionSpec
    from petals.kv_cache.specs import layer_kind

    if layer_kind(config, block_index)[0] == "linear_attention":
        width = config.linear_num_heads * config.linear_head_dim
        return LinearAttentionSpec(
            conv_dim=3 * width,
            conv_kernel=config.linear_conv_kernel_dim,
            recurrent_shape=(config.linear_num_heads, config.linear_head_dim, config.linear_head_dim),
        )

    return FullAttentionSpec(
        num_kv_heads=1,
        key_dim=config.kv_lora_rank,
        value_dim=config.qk_rope_head_dim,
        num_query_heads=config.num_attention_heads,
    )
