"""Entry point of the Llama plugin: registration and the Petals dht_prefix rule."""

from petals import hookimpl
from petals_llama.config import DistributedLlamaConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedLlamaConfig)


@hookimpl
def dht_prefix(model_id: str) -> str:
    prefix = model_id.rsplit("/", 1)[-1].replace(".", "-")
    return prefix if prefix.endswith("-hf") else f"{prefix}-hf"


@hookimpl
def tensor_parallel_config(config, world_size: int):
    from petals_llama.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
