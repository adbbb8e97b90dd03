"""Entry point of the LFM plugin: registration and the cache of LFM2's short-convolution layers.

Transformers names those layers ``conv``: each keeps, per sequence, the last ``conv_L_cache`` inputs of
its depthwise convolution over ``hidden_size`` channels, and nothing else, whatever the sequence's
length. They are served as a fixed-size state without a recurrent part; the attention layers keep
core's default description (keys and values of the attention's own projections)."""

from petals import hookimpl
from petals_lfm.config import DistributedLfm2Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedLfm2Config)


@hookimpl
def cache_spec(config, block_index: int):
    from petals.kv_cache import LinearAttentionSpec  # torch: not on loading plugins (a DHT peer has none)
    from petals.kv_cache.specs import layer_kind

    if layer_kind(config, block_index)[0] != "conv":
        return None
    return LinearAttentionSpec(
        conv_dim=config.hidden_size, conv_kernel=config.conv_L_cache, recurrent_shape=None
    )
