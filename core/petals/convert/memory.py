"""How much memory a served block's weights take: measured on a converted block, or estimated from its config.

How many blocks fit on a device is decided by ``petals.server.planning.plan_num_blocks``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig


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


# bytes per weight of a quantized matrix, scales included (nf4: 4 bits + int8 absmax per 64, nested)
QUANTIZED_BYTES_PER_WEIGHT = {"int8": 1.0, "nf4": 4.25 / 8}


def estimate_block_weight_bytes(
    config: PretrainedConfig, dtype: torch.dtype, quant_type: str = "none", block_index: int = 0
) -> int:
    """What ``block_weight_bytes`` will report for block ``block_index`` of ``config`` after conversion,
    without building it (blocks differ by index: DeepSeek V3's first is dense, 0.58B parameters, its
    others 11.5B with their experts).

    Matrices (2-D and 3-D expert weights) take the quantized size, vectors (norms, biases) ``dtype``;
    int8 adds its per-row fp32 scale. Built on the meta device, so it allocates nothing.
    """
    from petals.block import make_block

    with torch.device("meta"):
        block = make_block(config, block_index)
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
