"""Entry point of the DeepSeek plugin: registration, and the one hook Kimi Linear needs, ``cache_spec``.

DeepSeek's multi-head latent attention hands its cache the compressed latent (``kv_lora_rank``
values) and one rope key shared by all heads (``qk_rope_head_dim`` values), and expands them into
per-head keys and values only after reading the cache: for DeepSeek V3, 512 + 64 = 576 values per
token, where 128 expanded heads would take 128 x (192 key + 128 value) = 40,960, about 71 times more.
Core's default reads that latent from the configs' ``attn_class`` (``petals.kv_cache.specs.latent_widths``),
as for any family with such layers, so servers budget, and clients are routed, by the real size. What
is DeepSeek's own here is its attention served absorbed into the latent (``absorbed.py``, used by
``block.py``). The dht_prefix is core's default ("deepseek-ai/DeepSeek-V3" -> "DeepSeek-V3"): Petals
had no DeepSeek rule to reproduce.

Kimi Linear's latent attention layers cache the same latent and rope key (core's default again); its
Kimi Delta Attention layers keep, per sequence, the last ``linear_conv_kernel_dim`` inputs of a short
convolution over their queries, keys and values (``linear_num_heads x linear_head_dim`` each) and a
float32 ``linear_head_dim x linear_head_dim`` state per head: a fixed-size state, whatever the length,
sized by fields core's default does not read, hence the hook.
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
    """Kimi Linear's delta attention layers: their state. Latent attention layers: core's default (None)."""
    from petals.kv_cache import LinearAttentionSpec
    from petals.kv_cache.specs import layer_kind

    if layer_kind(config, block_index)[0] != "linear_attention":
        return None
    width = config.linear_num_heads * config.linear_head_dim
    return LinearAttentionSpec(
        conv_dim=3 * width,
        conv_kernel=config.linear_conv_kernel_dim,
        recurrent_shape=(config.linear_num_heads, config.linear_head_dim, config.linear_head_dim),
    )
