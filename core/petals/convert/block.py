"""What a server does to each loaded block before serving it (and before timing it for throughput)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from petals.convert.adapters import load_adapters
from petals.convert.quantization import QuantType, quantize_block
from petals.convert.tensor_parallel import make_tensor_parallel
from petals.formats.packed import dequantize_in_place


def convert_block(
    block: nn.Module,
    block_index: int,
    config: PretrainedConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    quant_type: QuantType | str = QuantType.NONE,
    tensor_parallel_devices: Sequence[torch.device | str] = (),
    adapters: Mapping[str, str | os.PathLike] = {},
    **hub_kwargs,
) -> nn.Module:
    """A block loaded on CPU (in ``dtype``), made ready to serve on ``device``.

    Either sharded over ``tensor_parallel_devices``, or quantized to ``quant_type`` on its way to
    ``device`` and given the LoRA ``adapters`` ``{name: directory or repo id}`` (``hub_kwargs`` go
    to their download). Both sharding and quantization start from dense weights: a quantized
    checkpoint's packed weights are dequantized first (so ``--quant_type`` quantizes every matrix again).
    """
    if tensor_parallel_devices or QuantType(quant_type) is not QuantType.NONE:
        dequantize_in_place(block)
    if tensor_parallel_devices:
        if QuantType(quant_type) is not QuantType.NONE or adapters:
            raise NotImplementedError(
                "tensor parallelism cannot be combined with quantization or adapters yet"
            )
        return make_tensor_parallel(block, config, tensor_parallel_devices)
    block = quantize_block(block, quant_type, compute_dtype=dtype, device=device)
    if adapters:
        load_adapters(block, block_index, adapters, config, **hub_kwargs)
    return block
