"""Entry point of the Falcon plugin: registration, tensor-parallel sharding (Petals' Falcon
dht_prefix rule, the last path part with "." replaced by "-", is core's default) and Falcon-H1's cache.

A Falcon-H1 layer caches both what its Mamba2 mixer keeps per sequence (the last ``mamba_d_conv`` inputs
of its convolution over ``x``, ``B`` and ``C``, and a ``head_dim x d_state`` float32 state per head) and
its attention's keys and values per token: a ``HybridSpec``."""

from petals import hookimpl
from petals_falcon.config import DistributedFalconConfig, DistributedFalconH1Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedFalconConfig)
    register(DistributedFalconH1Config)


@hookimpl
def cache_spec(config, block_index: int):
    if config.model_type != "falcon_h1":
        return None
    from petals.kv_cache import FullAttentionSpec, HybridSpec, LinearAttentionSpec  # torch: not on loading
    from petals.kv_cache.specs import attention_sizes

    inner = (
        config.mamba_d_ssm
        if config.mamba_d_ssm is not None
        else int(config.mamba_expand * config.hidden_size)
    )
    state = LinearAttentionSpec(
        conv_dim=inner + 2 * config.mamba_n_groups * config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        recurrent_shape=(config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state),
    )
    return HybridSpec(attention=FullAttentionSpec(**attention_sizes(config, block_index)), state=state)


@hookimpl
def tensor_parallel_config(config, world_size: int):
    if config.model_type == "falcon_h1":  # no plan for its Mamba2 mixer yet: reported as unsupported
        return None
    from petals_falcon.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
