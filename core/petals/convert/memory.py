"""How much memory a served block takes, and how many blocks fit on a device."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def block_weight_bytes(block: nn.Module) -> int:
    """Bytes of a block's weights as stored: every tensor of its state dict, quantization state included.

    bitsandbytes layers put their scales (``SCB``, nf4 ``absmax``/``quant_map``, nested statistics)
    into the state dict, so int8 and nf4 blocks are measured with their overhead. Tensors shared
    between names are counted once; non-persistent buffers (e.g. rotary frequencies) are not weights.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in block.state_dict(keep_vars=True).values():
        if not torch.is_tensor(tensor):
            continue
        key = (
            (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if tensor.numel()
            else (id(tensor), 0)
        )
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total


GiB = 1024**3
# bytes per weight of a quantized matrix, scales included (nf4: 4 bits + int8 absmax per 64, nested)
QUANTIZED_BYTES_PER_WEIGHT = {"int8": 1.0, "nf4": 4.25 / 8}


def estimate_block_weight_bytes(
    config: PretrainedConfig, dtype: torch.dtype, quant_type: str = "none"
) -> int:
    """What ``block_weight_bytes`` will report for one block of ``config`` after conversion, without building it.

    Matrices (2-D and 3-D expert weights) take the quantized size, vectors (norms, biases) ``dtype``;
    int8 adds its per-row fp32 scale. Built on the meta device, so it allocates nothing.
    """
    from petals.block import make_block

    with torch.device("meta"):
        block = make_block(config)
    total = 0.0
    for parameter in block.parameters():
        if quant_type == "none" or parameter.ndim < 2:
            total += parameter.numel() * dtype.itemsize
        else:
            rows = parameter.numel() // parameter.shape[-1]
            total += parameter.numel() * QUANTIZED_BYTES_PER_WEIGHT[quant_type] + (
                4 * rows if quant_type == "int8" else 0
            )
    return int(total)


def device_memory_bytes(device: torch.device | str) -> int:
    """Memory a server may fill on ``device``: the GPU's total memory, or the host's available RAM on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    return psutil.virtual_memory().available


def adapter_bytes_per_block(config: PretrainedConfig, adapter_files: Mapping[str, os.PathLike]) -> int:
    """LoRA weights per block: each adapter's safetensors size spread over the model's blocks."""
    return sum(Path(path).stat().st_size for path in adapter_files.values()) // config.num_hidden_layers


def plan_num_blocks(
    config: PretrainedConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_type: str = "none",
    attn_cache_tokens: int = 16384,
    *,
    adapter_files: Mapping[str, os.PathLike] = {},
    tensor_parallel_devices: Sequence[torch.device | str] = (),
    memory_bytes: int | None = None,
) -> tuple[int, str]:
    """How many blocks fit in device memory, and the arithmetic behind it (also logged).

    Per block: weights after quantization + a KV cache of ``attn_cache_tokens`` tokens (exact
    key/value heads, so grouped-query attention counts) + LoRA adapters. Reserved once: 2 GiB per
    device for autograd, scaled by hidden size as in Petals (``2 GiB * devices / 14336 * hidden``).
    With tensor parallelism the devices' memories add up (counted as ``n * min``).
    ``memory_bytes`` overrides the measured total. Capped at the model's number of blocks.
    """
    from petals.block import kv_cache_layout

    devices = [torch.device(d) for d in tensor_parallel_devices] or [torch.device(device)]
    if memory_bytes is None:
        memory_bytes = len(devices) * min(device_memory_bytes(d) for d in devices)
    weights = estimate_block_weight_bytes(config, dtype, quant_type)
    cache = attn_cache_tokens * kv_cache_layout(config).bytes_per_token(dtype)
    adapters = adapter_bytes_per_block(config, adapter_files)
    per_block = weights + cache + adapters
    autograd = int(2 * GiB * len(devices) / 14336 * config.hidden_size)
    fits = max(0, (memory_bytes - autograd) // per_block)
    num_blocks = min(fits, config.num_hidden_layers)
    explanation = (
        f"{num_blocks} blocks = min(floor(({_gib(memory_bytes)} memory on {', '.join(map(str, devices))} "
        f"- {_gib(autograd)} autograd reserve) / {_gib(per_block)} per block), {config.num_hidden_layers} in the model); "
        f"per block: {_gib(weights)} weights ({quant_type}, {str(dtype).removeprefix('torch.')}) "
        f"+ {_gib(cache)} KV cache for {attn_cache_tokens} tokens + {_gib(adapters)} adapters"
    )
    logger.info("Memory plan: %s", explanation)
    if num_blocks < 1:
        raise ValueError(
            f"not even one block fits: {explanation}. Use --quant_type nf4, fewer --attn_cache_tokens, "
            "or set --num_blocks explicitly"
        )
    return num_blocks, explanation


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.3f} GiB"
