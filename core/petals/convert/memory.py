"""How much memory a served block's weights take: measured on a converted block, or estimated from its config.

How many blocks fit on a device is decided by ``petals.server.planning.plan_num_blocks``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from petals.convert.quantization import nbytes, weight_matrices
from petals.formats import StoredWeights


def block_weight_bytes(block: nn.Module) -> int:
    """Bytes of a block's weights as held: every tensor of its state dict, quantization state included.

    bitsandbytes layers put their scales (``SCB``, nf4 ``absmax``/``quant_map``, nested statistics)
    into the state dict, and packed weights their stored parts, so quantized blocks are measured with
    their overhead. Tensors shared between names are counted once; non-persistent buffers (e.g. rotary
    frequencies) are not weights.
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


def estimate_block_weight_bytes(
    config: PretrainedConfig,
    dtype: torch.dtype,
    quant_type: str = "none",
    block_index: int = 0,
    stored: StoredWeights | None = None,
) -> int:
    """What ``block_weight_bytes`` will report for block ``block_index`` of ``config`` after conversion,
    without building it (blocks differ by index: DeepSeek V3's first is dense, 0.58B parameters, its
    others 11.5B with their experts).

    Weight matrices (``weight_matrices``) take what ``quant_type`` makes of them, else what their
    checkpoint's format (``stored``, served packed) stores them in, else ``dtype``; other tensors take
    ``dtype`` (float32 where transformers keeps them so). Built on the meta device: allocates nothing.
    """
    from petals.block import make_block
    from petals.loading import kept_in_float32

    with torch.device("meta"):
        block = make_block(config, block_index)
    matrices = {name: is_experts for name, _, is_experts in weight_matrices(block)}
    kept = kept_in_float32(type(block), dtype)
    prefix = f"{config.block_prefix}.{block_index}."
    total = 0
    for name, tensor in block.state_dict().items():
        if name in matrices and quant_type != "none":
            total += nbytes(quant_type, tensor.shape)
            continue
        packed = (
            stored.matrix_nbytes(prefix + name, tensor.shape, matrices[name])
            if name in matrices and stored
            else None
        )
        if packed is not None:
            total += packed
        elif tensor.is_floating_point():
            total += tensor.numel() * (4 if kept and kept.search(name) else dtype.itemsize)
        else:
            total += tensor.numel() * tensor.element_size()
    return total
