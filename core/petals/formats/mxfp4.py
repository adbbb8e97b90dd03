"""MXFP4 experts as GPT-OSS publishes them (``quant_method: mxfp4``).

``P_blocks`` (uint8 ``[experts, rows, groups, 16]``: two FP4 e2m1 codes a byte, low nibble first, 32
codes a group along the input) with ``P_scales`` (uint8 e8m0 ``[experts, rows, groups]``: the group's
power of two + 127) for ``P`` in ``gate_up_proj``, ``down_proj``; rows are outputs, and transformers'
GPT-OSS experts hold the transpose (``[experts, in, out]``). Everything else is dense
(``modules_to_not_convert``: attention, router, embeddings, head).

The decoding is the one transformers' ``convert_moe_packed_tensors`` does (a table of the 16 FP4 values,
then times two to the exponent, both exact in any float dtype), with a table of every (exponent, byte)
pair that decodes a byte's two codes, already scaled, in one lookup; per expert, so that a step
dequantizes only the experts it routes to.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from petals.formats.base import CheckpointFormatError, WeightFormat
from petals.formats.packed import PackedWeight

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
BAND_BYTES = 1 << 18  # packed bytes decoded at a time on CPU (see _decode)
DEVICE_BAND_BYTES = 1 << 24  # elsewhere every operation is a kernel launch: bands only bound temporaries


@functools.cache
def _scaled_pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256 * 256, 2]``: row ``256 * e + b`` holds byte ``b``'s two FP4 values (low nibble first) times
    ``2 ** (e - 127)``, multiplied in ``dtype`` as a byte's values and its group's power have always been.
    Built once per dtype and device (256 KiB in bfloat16), so that a byte and its exponent decode in a
    single lookup, with no multiplication left per value."""
    values = torch.tensor(FP4_VALUES, dtype=dtype, device=device)
    codes = torch.arange(256, device=device)
    pairs = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1)
    powers = torch.exp2(torch.arange(256, dtype=torch.float32, device=device) - 127).to(dtype)
    return (pairs[None] * powers[:, None, None]).reshape(256 * 256, 2)


class Mxfp4Weight(PackedWeight):
    """Experts ``[experts, groups * 32, rows]`` (transformers' layout) held as GPT-OSS stores them."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str) -> None:
        if (
            blocks.dtype != torch.uint8
            or scales.dtype != torch.uint8
            or blocks.ndim != 4
            or blocks.shape[-1] != 16
        ):
            raise CheckpointFormatError(
                f"{name}: {blocks.dtype} blocks of shape {tuple(blocks.shape)} with {scales.dtype} scales are "
                "not the mxfp4 layout petals reads (uint8 [experts, rows, groups, 16] blocks, uint8 scales)"
            )
        if blocks.shape[:-1] != scales.shape:
            raise CheckpointFormatError(
                f"{name}: blocks {tuple(blocks.shape)} need scales of shape {tuple(blocks.shape[:-1])}, "
                f"the checkpoint has {tuple(scales.shape)}"
            )
        experts, rows, groups, _ = blocks.shape
        super().__init__((experts, groups * GROUP, rows), dtype)
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)

    def expert(self, index: int) -> torch.Tensor:
        """``[in, out]``, a transposed view of the decoded rows: a matmul reads it as it is, a copy to
        make it contiguous would cost more than the decoding."""
        return _decode(self.blocks[index], self.scales[index], self.dtype).T

    def dequantize(self) -> torch.Tensor:
        return torch.stack([self.expert(index) for index in range(self.shape[0])])


def _decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, groups, 16]`` bytes and ``[rows, groups]`` exponents → ``[rows, groups * 32]`` values, a band
    of rows at a time (the band's indices stay in the core's cache)."""
    rows, groups, _ = blocks.shape
    table = _scaled_pairs(dtype, blocks.device)
    out = torch.empty(rows, groups * GROUP, dtype=dtype, device=blocks.device)
    band_bytes = BAND_BYTES if blocks.device.type == "cpu" else DEVICE_BAND_BYTES
    band = max(1, band_bytes // (groups * 16))
    for start in range(0, rows, band):
        index = blocks[start : start + band].to(torch.int32)
        index.add_(scales[start : start + band, :, None].to(torch.int32), alpha=256)
        _lookup(table, index.view(-1), out[start : start + band])
    return out


def _lookup(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` := the pairs ``table[index]``, each pair gathered as one integer of its two values' bits
    where one is wide enough (several times faster than gathering rows of two)."""
    pair = {2: torch.int32, 4: torch.int64}.get(table.element_size())
    pairs = table if pair is None else table.view(pair).squeeze(1)
    torch.index_select(pairs, 0, index, out=out.view(pairs.dtype).view(-1, *pairs.shape[1:]))


class Mxfp4Format(WeightFormat):
    name = "mxfp4"
    quant_methods = ("mxfp4",)
    companion_suffixes = ()

    def pack(self, tensors, quantization_config, dtype):
        packed: dict[str, torch.Tensor | PackedWeight] = {
            name: tensor for name, tensor in tensors.items() if not name.endswith(("_blocks", "_scales"))
        }
        for name, blocks in tensors.items():
            if not name.endswith("_blocks"):
                continue
            weight_name = name.removesuffix("_blocks")
            scales = tensors.get(weight_name + "_scales")
            if scales is None:
                raise CheckpointFormatError(f"{name} has no {weight_name}_scales to scale it")
            packed[weight_name] = Mxfp4Weight(blocks, scales, dtype, name)
        orphans = [
            n
            for n in tensors
            if n.endswith("_scales") and n.removesuffix("_scales") + "_blocks" not in tensors
        ]
        if orphans:
            raise CheckpointFormatError(f"mxfp4 scales without their blocks: {', '.join(sorted(orphans))}")
        return packed

    def matrix_nbytes(self, shape, quantization_config: dict[str, Any]) -> int:
        *lead, inputs, outputs = shape  # transformers' [experts, in, out]
        groups = math.ceil(inputs / GROUP)
        return math.prod(lead) * outputs * groups * (16 + 1)

    def stores_packed(self, module_path, is_experts, quantization_config):
        return is_experts and super().stores_packed(module_path, is_experts, quantization_config)


MXFP4 = Mxfp4Format()
