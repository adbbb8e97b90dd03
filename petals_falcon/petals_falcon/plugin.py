"""Entry point of the Falcon plugin: registration and tensor-parallel sharding (Petals' Falcon
dht_prefix rule, the last path part with "." replaced by "-", is core's default)."""

from petals import hookimpl
from petals_falcon.config import DistributedFalconConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedFalconConfig)


@hookimpl
def tensor_parallel_config(config, world_size: int):
    from petals_falcon.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
