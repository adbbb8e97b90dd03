"""GGUF quant types: which are block-quantized, and their dequantization."""

from __future__ import annotations

import numpy as np
import torch

FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16, 28: torch.float64}
INTEGER_TYPES = (24, 25, 26, 27)  # I8, I16, I32, I64


def is_quantized(qtype: int) -> bool:
    return int(qtype) not in FLOAT_TYPES and int(qtype) not in INTEGER_TYPES


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` (a GGUF tensor's data: uint8 rows of blocks, or the values of a float type) → ``shape``
    in ``dtype``."""
    qtype = int(qtype)
    if not is_quantized(qtype):
        return raw.reshape(shape).to(dtype)
    from gguf.quants import dequantize as numpy_dequantize

    values = numpy_dequantize(raw.cpu().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).to(dtype=dtype, device=raw.device)
