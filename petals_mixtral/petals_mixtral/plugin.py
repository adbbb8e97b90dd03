"""Entry point of the Mixtral plugin: registration, dht_prefix rule and tensor-parallel sharding
(transformers' own mapping fuses the per-expert checkpoint tensors; core quantizes the fused experts)."""

from petals import hookimpl
from petals_mixtral.config import DistributedMixtralConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedMixtralConfig)


@hookimpl
def dht_prefix(model_id: str) -> str:
    return model_id.replace(".", "-")


@hookimpl
def tensor_parallel_config(config, world_size: int):
    from petals_mixtral.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
