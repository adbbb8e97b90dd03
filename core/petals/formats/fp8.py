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

Dequantizing (the same function at load and per forward) computes ``codes * scale`` in float32 and rounds
once to the serving dtype. The codes are decoded from their bits (integer shifts into a float32's
fields, the power of two that is missing folded into the scale), a band of rows at a time: on CPU this is
4-6x faster than torch's float8 cast and gives the same bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from petals.formats.base import FP8_DTYPES, CheckpointFormatError, WeightFormat, excluded
from petals.formats.packed import PackedWeight

DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
ACTIVATION_SCALES = ("input_scale", "activation_scale", "output_scale")
BAND_ELEMENTS = 1 << 18  # values dequantized at a time on CPU (see _dequantize_matrix)
DEVICE_BAND_ELEMENTS = 1 << 24  # elsewhere every operation is a kernel launch: bands only bound temporaries


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
        return _dequantize(self.codes, self.scale, self.block, self.dtype, self._exact_from_bits)

    def expert(self, index: int) -> torch.Tensor:
        scale = self.scale if self.scale.ndim == 0 else self.scale[index]
        return _dequantize(self.codes[index], scale, self.block, self.dtype, self._exact_from_bits)

    @functools.cached_property
    def _exact_from_bits(self) -> bool:
        """Whether ``_decode_bits`` decodes these codes exactly: every code finite, and every finite scale
        still finite times the power of two it takes (checked once, at the first dequantization)."""
        power = 2.0 ** _BIT_LAYOUT[self.codes.dtype][2]
        scale = self.scale.to(torch.float32)
        return _all_finite(self.codes) and torch.equal(torch.isfinite(scale * power), torch.isfinite(scale))


# float8 dtype: (bits its codes move left to sit in a float32's bits, the float32 bits kept, the power
# of two by which that float32 falls short of the code's value: 2 ** (127 - the format's exponent bias))
_BIT_LAYOUT = {
    torch.float8_e4m3fn: (20, 0x87F00000 - 2**32, 120),  # sign, 4 exponent and 3 mantissa bits
    torch.float8_e5m2: (21, 0x8FE00000 - 2**32, 112),  # sign, 5 exponent and 2 mantissa bits
}
_SPECIAL_BITS = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}  # NaN (e4m3fn), inf and NaN (e5m2)


def _dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
    from_bits: bool,
) -> torch.Tensor:
    """``codes * scale`` in float32, rounded once to ``dtype``, one matrix at a time."""
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    if codes.ndim == 2:
        _dequantize_matrix(codes, scale, block, out, from_bits)
        return out
    rows, cols = codes.shape[-2:]
    scales = scale.reshape(-1, *scale.shape[-2:]) if scale.ndim else scale.expand(codes.shape[:-2].numel())
    for matrix, matrix_scale, matrix_out in zip(
        codes.reshape(-1, rows, cols), scales, out.view(-1, rows, cols), strict=True
    ):
        _dequantize_matrix(matrix, matrix_scale, block, matrix_out, from_bits)
    return out


def _dequantize_matrix(
    codes: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    out: torch.Tensor,
    from_bits: bool,
) -> None:
    """Fill ``out`` with ``codes * scale``, a band of rows at a time: the band's float32 temporaries stay
    in the core's cache through the whole chain of operations, where a whole weight's would go out to
    memory and back at each. An elementwise product: the same values whatever the bands."""
    rows, cols = codes.shape
    scale = scale.to(torch.float32)
    if from_bits:
        scale = scale * 2.0 ** _BIT_LAYOUT[codes.dtype][2]
    if block is not None:  # [rows, blocks of columns]: the block scales of each row
        scale = scale.repeat_interleave(block[0], dim=0)[:rows]
    band = max(1, _band_elements(codes.device) // cols)
    in_place = out.dtype == torch.float32  # decoded straight into the output
    workspace = None if in_place else torch.empty(min(band, rows), cols, device=codes.device)
    for start in range(0, rows, band):
        stop = min(start + band, rows)
        values = out[start:stop] if in_place else workspace[: stop - start]
        (_decode_bits if from_bits else _decode_cast)(codes[start:stop], values)
        _scale(values, scale if scale.ndim == 0 else scale[start:stop], block)
        if not in_place:
            out[start:stop] = values  # rounded once to the serving dtype


def _band_elements(device: torch.device) -> int:
    return BAND_ELEMENTS if device.type == "cpu" else DEVICE_BAND_ELEMENTS


def _decode_bits(codes: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` := each code's value divided by its format's power of two (``_BIT_LAYOUT``), exactly: the
    code's sign, exponent and mantissa bits moved into a float32's (a subnormal code becomes a subnormal
    float32, denormals not being flushed, as torch leaves them). Three integer passes, where torch's own
    float8 cast converts one value at a time on CPU, several times slower. NaN and infinite codes would come
    out finite: weights holding any are decoded by ``_decode_cast``."""
    shift, kept, _ = _BIT_LAYOUT[codes.dtype]
    bits = values.view(torch.int32)
    bits.copy_(codes.view(torch.int8))  # sign-extended: the sign bit lands on bit 31 after the shift
    bits.bitwise_left_shift_(shift).bitwise_and_(kept)


def _decode_cast(codes: torch.Tensor, values: torch.Tensor) -> None:
    values.copy_(codes)


def _all_finite(codes: torch.Tensor) -> bool:
    """Whether no code is NaN or infinite (quantizers clamp to the largest finite value), a band at a time."""
    special, band = _SPECIAL_BITS[codes.dtype], _band_elements(codes.device)
    flat = codes.reshape(-1).view(torch.uint8)
    return not any(
        (flat[start : start + band] & special).eq_(special).any() for start in range(0, flat.numel(), band)
    )


def _scale(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    """``values`` times ``scale`` in place: one scale, one per row (``[rows, 1]``), or one per row and
    block of columns, each broadcast over its block's columns (a view, never a scale per value)."""
    if scale.ndim == 0 or scale.shape[1] == 1:
        values.mul_(scale)
        return
    whole = values.shape[1] // block[1]
    values[:, : whole * block[1]].unflatten(1, (whole, block[1])).mul_(scale[:, :whole, None])
    if whole < scale.shape[1]:  # the cropped last block of columns
        values[:, whole * block[1] :].mul_(scale[:, whole:])


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
