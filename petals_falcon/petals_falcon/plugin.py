"""Entry point of the Falcon plugin: registration and the Petals dht_prefix rule."""

from petals import hookimpl
from petals_falcon.config import DistributedFalconConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedFalconConfig)


@hookimpl
def dht_prefix(model_id: str, config) -> str | None:
    if not isinstance(config, DistributedFalconConfig):
        return None
    return model_id.rsplit("/", 1)[-1].replace(".", "-")


@hookimpl
def tensor_parallel_config(config, world_size: int):
    if not isinstance(config, DistributedFalconConfig):
        return None
    from petals_falcon.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
