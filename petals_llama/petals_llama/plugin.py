"""Entry point of the Llama plugin: registration, the Petals dht_prefix rule and Llama's tensor-parallel
split. Both answer for Llama alone: Llama 4 (text) and SmolLM3 keep core's dht_prefix (the original
Petals never served them, so no swarm expects the "-hf" suffix there) and have no tensor-parallel plan
(Llama 4's experts and shared expert are no Llama MLP)."""

from petals import hookimpl
from petals_llama.config import DistributedLlama4TextConfig, DistributedLlamaConfig, DistributedSmolLM3Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedLlamaConfig)
    register(DistributedLlama4TextConfig)
    register(DistributedSmolLM3Config)


@hookimpl
def dht_prefix(model_id: str, config) -> str | None:
    if config.model_type != "llama":
        return None
    prefix = model_id.rsplit("/", 1)[-1].replace(".", "-")
    return prefix if prefix.endswith("-hf") else f"{prefix}-hf"


@hookimpl
def tensor_parallel_config(config, world_size: int):
    if config.model_type != "llama":
        return None
    from petals_llama.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
