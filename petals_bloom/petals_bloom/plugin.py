"""Entry point of the BLOOM plugin: registration and the Petals dht_prefix rule."""

from petals import hookimpl
from petals_bloom.config import DistributedBloomConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedBloomConfig)


@hookimpl
def dht_prefix(model_id: str) -> str:
    return f"{model_id}-petals".replace(".", "-")


@hookimpl
def tensor_parallel_config(config, world_size: int):
    from petals_bloom.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
