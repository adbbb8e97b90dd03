"""Entry point of the Mixtral plugin: registration, dht_prefix rule, expert quantization and
tensor-parallel sharding (transformers' own mapping fuses the per-expert checkpoint tensors)."""

from petals import hookimpl
from petals_mixtral.config import DistributedMixtralConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedMixtralConfig)


@hookimpl
def dht_prefix(model_id: str) -> str:
    return model_id.replace(".", "-")


@hookimpl
def quantize_module(module, quantize_linear):
    """Fused experts are 3-D parameters, not ``nn.Linear``: rebuild them as quantized per-expert linears."""
    if type(module).__name__ != "MixtralExperts":
        return None
    from petals_mixtral.quantization import QuantizedExperts

    return QuantizedExperts(module, quantize_linear)


@hookimpl
def tensor_parallel_config(config, world_size: int):
    from petals_mixtral.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
