"""Entry point of the Mixtral plugin: registration, dht_prefix rule, checkpoint conversion,
expert quantization and tensor-parallel sharding."""

import re

import torch

from petals import hookimpl
from petals_mixtral.config import DistributedMixtralConfig

_EXPERT_KEY = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


@hookimpl
def register_model_families(register) -> None:
    register(DistributedMixtralConfig)


@hookimpl
def dht_prefix(model_id: str, config) -> str | None:
    if not isinstance(config, DistributedMixtralConfig):
        return None
    return model_id.replace(".", "-")


@hookimpl
def convert_block_state_dict(config, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Checkpoints keep one tensor per expert (w1 gate, w3 up, w2 down); transformers 5 fuses them."""
    if not isinstance(config, DistributedMixtralConfig):
        return None
    experts: dict[int, dict[str, torch.Tensor]] = {}
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        match = _EXPERT_KEY.fullmatch(key)
        if match:
            experts.setdefault(int(match[1]), {})[match[2]] = tensor
        else:
            converted[key.replace("block_sparse_moe.", "mlp.")] = tensor
    if experts:
        if sorted(experts) != list(range(config.num_local_experts)):
            raise ValueError(f"block has experts {sorted(experts)}, expected {config.num_local_experts}")
        ordered = [experts[index] for index in range(config.num_local_experts)]
        converted["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e["w1"], e["w3"]]) for e in ordered])
        converted["mlp.experts.down_proj"] = torch.stack([e["w2"] for e in ordered])
    return converted


@hookimpl
def quantize_module(config, module, quantize_linear):
    """Fused experts are 3-D parameters, not ``nn.Linear``: rebuild them as quantized per-expert linears."""
    if not isinstance(config, DistributedMixtralConfig) or type(module).__name__ != "MixtralExperts":
        return None
    from petals_mixtral.quantization import QuantizedExperts

    return QuantizedExperts(module, quantize_linear)


@hookimpl
def tensor_parallel_config(config, world_size: int):
    if not isinstance(config, DistributedMixtralConfig):
        return None
    from petals_mixtral.tensor_parallel import tensor_parallel_config

    return tensor_parallel_config(config, world_size)
