"""FP8 weights: float8 codes with float32 (or bfloat16) scales, per block, per output channel or per tensor.

Layouts read, each a ``weight`` of ``float8_e4m3fn``/``e5m2`` and a scale ``s`` with ``W = weight * s``:

- ``quant_method: fp8`` (transformers' ``FineGrainedFP8Config``: DeepSeek V3/R1, Kimi K2, Qwen3 FP8): the
  scale is ``weight_scale_inv``, one per ``weight_block_size`` block (edge blocks cropped; 128x128 when
  the key is absent) or one per tensor (``weight_block_size: null``);
- the same method as AutoFP8 writes it: ``weight_scale`` (one per tensor, or ``[out, 1]`` per channel)
  and ``input_scale``;
- ``quant_method: compressed-tensors`` with ``format`` ``float-quantized``/``naive-quantized`` (llm-compressor's
  FP8 releases): ``weight_scale`` per tensor, channel or block (``strategy``), matrices named in ``ignore``
  stored dense.

Static activation scales (``input_scale``, ``activation_scale``) are dropped: activations compute in the
serving dtype, as with transformers' dequantized load. transformers 5.24 drops the AutoFP8 scales and
reads those weights unscaled (``reference/packed-weights.md``); here they are read. A float8 weight
without a scale is refused, never read as if unscaled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from petals.formats import FP8_DTYPES, CheckpointFormatError, WeightFormat, excluded
from petals.formats.packed import PackedWeight

DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
ACTIVATION_SCALES = ("input_scale", "activation_scale", "output_scale")
ROWS_PER_BAND = 256  # rows dequantized at a time: float32 temporaries of a band, not of the whole weight


class Fp8Weight(PackedWeight):
    """``codes [..., rows, cols]`` (float8) with ``scale``: a scalar, ``[..., rows, 1]`` per channel, or
    ``[..., ceil(rows / b0), ceil(cols / b1)]`` per block of ``block``."""

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        block: Sequence[int] | None,
        dtype: torch.dtype,
        name: str,
    ) -> None:
        if codes.dtype not in FP8_DTYPES or scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointFormatError(
                f"{name}: a {codes.dtype} weight with {scale.dtype} scales is not an fp8 layout petals reads "
                "(float8 weights, float scales)"
            )
        rows, cols = codes.shape[-2:]
        lead = tuple(codes.shape[:-2])
        if scale.numel() == 1:
            block, scale = None, scale.reshape(())
        elif tuple(scale.shape) in ((*lead, rows, 1), (*lead, rows)):
            block, scale = None, scale.reshape(*lead, rows, 1)
        else:
            block = tuple(block or DEFAULT_BLOCK)
            grid = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
            if tuple(scale.shape) != grid:
                raise CheckpointFormatError(
                    f"{name}: weight {tuple(codes.shape)} in blocks of {list(block)} needs scales of shape "
                    f"{grid} (or one per tensor or per row), the checkpoint has {tuple(scale.shape)}"
                )
        super().__init__(codes.shape, dtype)
        self.block = block
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    def dequantize(self) -> torch.Tensor:
        return _dequantize(self.codes, self.scale, self.block, self.dtype)

    def expert(self, index: int) -> torch.Tensor:
        scale = self.scale if self.scale.ndim == 0 else self.scale[index]
        return _dequantize(self.codes[index], scale, self.block, self.dtype)


def _dequantize(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``codes * scale`` in float32, rounded once to ``dtype``, a band of rows at a time (an elementwise
    product: the same values whatever the bands)."""
    rows = codes.shape[-2]
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    band = ROWS_PER_BAND if block is None else max(block[0], ROWS_PER_BAND // block[0] * block[0])
    for start in range(0, rows, band):
        stop = min(start + band, rows)
        values = codes[..., start:stop, :].to(torch.float32)
        values.mul_(_band_scale(scale, block, start, stop, codes.shape[-1]))
        out[..., start:stop, :] = values
    return out


def _band_scale(
    scale: torch.Tensor, block: tuple[int, int] | None, start: int, stop: int, cols: int
) -> torch.Tensor:
    scale = scale.to(torch.float32)
    if block is None:
        return scale if scale.ndim == 0 else scale[..., start:stop, :]
    grid_rows = scale[..., start // block[0] : -(-stop // block[0]), :]
    expanded = grid_rows.repeat_interleave(block[0], dim=-2)
    offset = start - start // block[0] * block[0]
    return expanded[..., offset : offset + stop - start, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def _pack_fp8(
    tensors: dict[str, torch.Tensor], block: Sequence[int] | None, dtype: torch.dtype
) -> dict[str, torch.Tensor | PackedWeight]:
    packed: dict[str, torch.Tensor | PackedWeight] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        base = name.rsplit(".", 1)[-1]
        if base in ACTIVATION_SCALES:
            continue  # activations compute in the serving dtype
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith("weight" + s)), None)
        if suffix is not None:
            scales[name.removesuffix(suffix)] = tensor
        else:
            packed[name] = tensor
    for weight_name, scale in scales.items():
        codes = packed.get(weight_name)
        if codes is None:
            raise CheckpointFormatError(f"{weight_name}: its scale is stored without the weight it scales")
        packed[weight_name] = Fp8Weight(codes, scale, block, dtype, weight_name)
    unscaled = sorted(
        name for name, value in packed.items() if torch.is_tensor(value) and value.dtype in FP8_DTYPES
    )
    if unscaled:
        raise CheckpointFormatError(
            f"fp8 tensors without a scale (weight_scale_inv or weight_scale): {', '.join(unscaled)}"
        )
    return packed


def _fp8_nbytes(shape: Sequence[int], block: Sequence[int] | None, per_channel: bool = False) -> int:
    *lead, rows, cols = shape
    experts = math.prod(lead)
    if block is not None:
        scales = math.ceil(rows / block[0]) * math.ceil(cols / block[1])
    else:
        scales = rows if per_channel else 1
    return experts * (rows * cols + 4 * scales)


class Fp8Format(WeightFormat):
    """``quant_method: fp8``: DeepSeek-style block scales (``weight_scale_inv``) or AutoFP8's ``weight_scale``."""

    name = "fp8"
    quant_methods = ("fp8",)
    companion_suffixes = ("_scale_inv", "_scale")

    def check(self, quantization_config: dict[str, Any]) -> None:
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt not in ("e4m3", "e5m2", "float8_e4m3fn"):
            raise CheckpointFormatError(f"fp8 with fmt {fmt!r} is not one petals reads (e4m3, e5m2)")

    def pack(self, tensors, quantization_config, dtype):
        return _pack_fp8(tensors, _block(quantization_config), dtype)

    def matrix_nbytes(self, shape, quantization_config):
        if (
            "weight_block_size" not in quantization_config
            and quantization_config.get("activation_scheme") == "static"
        ):
            return _fp8_nbytes(shape, None)  # AutoFP8: one scale per tensor
        return _fp8_nbytes(shape, _block(quantization_config))

    def describe(self, quantization_config):
        block = _block(quantization_config)
        return f"fp8 ({'x'.join(map(str, block))} blocks)" if block else "fp8 (per tensor)"


def _block(quantization_config: dict[str, Any]) -> tuple[int, int] | None:
    if "weight_block_size" not in quantization_config:
        return DEFAULT_BLOCK
    block = quantization_config["weight_block_size"]
    return tuple(block) if block else None


class CompressedTensorsFormat(WeightFormat):
    """``quant_method: compressed-tensors``, its float (FP8) formats; the others are refused by name."""

    name = "compressed-tensors"
    quant_methods = ("compressed-tensors",)
    companion_suffixes = ("_scale",)
    FLOAT_FORMATS = ("float-quantized", "naive-quantized")

    def check(self, quantization_config):
        fmt = quantization_config.get("format")
        if fmt not in self.FLOAT_FORMATS:
            raise CheckpointFormatError(
                f"compressed-tensors format {fmt!r} is not one petals reads yet (it reads the FP8 formats: "
                f"{', '.join(self.FLOAT_FORMATS)}); serve an unquantized release of the model"
            )
        for group in quantization_config.get("config_groups", {}).values():
            weights = group.get("weights") or {}
            if weights.get("type", "float") != "float" or weights.get("num_bits", 8) != 8:
                raise CheckpointFormatError(
                    f"compressed-tensors weights of {weights.get('num_bits')} bits of type {weights.get('type')!r} "
                    "are not a layout petals reads (8-bit float)"
                )

    def pack(self, tensors, quantization_config, dtype):
        return _pack_fp8(tensors, self._weights(quantization_config).get("block_structure"), dtype)

    def matrix_nbytes(self, shape, quantization_config):
        weights = self._weights(quantization_config)
        strategy = weights.get("strategy", "tensor")
        block = weights.get("block_structure") if strategy == "block" else None
        return _fp8_nbytes(shape, block, per_channel=strategy == "channel")

    def stores_packed(self, module_path, is_experts, quantization_config):
        return not excluded(module_path, quantization_config.get("ignore") or ())

    def describe(self, quantization_config):
        return f"fp8 (compressed-tensors, per {self._weights(quantization_config).get('strategy', 'tensor')})"

    @staticmethod
    def _weights(quantization_config: dict[str, Any]) -> dict[str, Any]:
        groups = list((quantization_config.get("config_groups") or {}).values())
        return (groups[0].get("weights") or {}) if groups else {}


FP8 = Fp8Format()
COMPRESSED_TENSORS = CompressedTensorsFormat()
