"""Entry point of the Falcon plugin: registration and tensor-parallel sharding (Petals' Falcon dht_prefix
rule, the last path part with "." replaced by "-", is core's default).

A Falcon-H1 layer caches both what its Mamba2 mixer keeps per sequence (the last ``mamba_d_conv`` inputs
of its convolution over ``x``, ``B`` and ``C``, and a ``head_dim x d_state`` float32 state per head) and
its attention's keys and values per token: core's default cache description measures both from the
block (a ``HybridSpec``)."""

from petals import hookimpl
from petals_falcon.config import DistributedFalconConfig, DistributedFalconH1Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedFalconConfig)
    register(DistributedFalconH1Config)


@hookimpl
def tensor_parallel_config(config, world_size: int):
    if config.model_type == "falcon_h1":  # no plan for its Mamba2 mixer yet: reported as unsupported
        return None
    from petals_falcon.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
