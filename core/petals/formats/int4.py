"""GPTQ and AWQ linears: integer codes in int32 words with per-group scales and zero points.

``W[o, i] = scales[g, o] * (q[i, o] - z[g, o])`` with ``g`` the input's group. Written by hand from the
formats' specifications: transformers reads them only through gptqmodel/autoawq kernels, which petals
does not depend on.

- GPTQ (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[in * bits / 32, out]`` packed along the input (row
  ``r`` holds inputs ``r * 32 / bits ...``, the first in the lowest bits), ``qzeros`` int32
  ``[groups, out * bits / 32]`` packed along the output the same way, ``scales`` ``[groups, out]``,
  ``g_idx`` ``[in]`` (each input's group; act-order checkpoints, ``desc_act``, permute it), an optional
  ``bias``. ``checkpoint_format`` ``"gptq"`` (v1) stores ``z - 1``, ``"gptq_v2"`` stores ``z``. Bits 2, 4, 8.
- AWQ, GEMM version (AutoAWQ's ``WQLinear_GEMM``): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros``
  int32 ``[in / group_size, out / 8]``, both packed along the output in AWQ's interleaved order (outputs
  0, 2, 4, 6, 1, 3, 5, 7 of each eight, lowest bits first), ``scales`` ``[in / group_size, out]``. Other
  versions (GEMV, marlin, ...) pack differently and are refused, as is ``zero_point: false``.

A 4-bit weight whose shape torch's CPU int4 kernel takes is held for it (``GroupedInt4Weight``): its
codes repacked into the kernel's layout, its inputs sorted by group where an act-order checkpoint
permutes them, its scales and zero points exact beside each other. bfloat16 decode steps run the
kernel; everything else dequantizes those fields to the same weights as the stored form.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import petals.formats.int4pack as int4pack
from petals.formats.base import CheckpointFormatError, WeightFormat
from petals.formats.packed import PackedWeight

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # where output k of eight sits among a packed int32's nibbles
CHUNK_ELEMENTS = 1 << 18  # weights dequantized at a time (whole runs of 32 inputs)


def unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of ``32 / bits`` values (the first in the lowest bits) → int32 values, along ``dim``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts[None, :, None]) & mask  # [rows, per word, cols]
        return values.reshape(-1, packed.shape[1])
    values = (packed.unsqueeze(2) >> shifts[None, None, :]) & mask  # [rows, cols, per word]
    return values.reshape(packed.shape[0], -1)


class GroupedIntWeight(PackedWeight):
    """A linear's ``[out, in]`` weight as integer codes with per-group scales and zero points, held as
    the checkpoint stores them; ``unpack_inputs(start, stop)`` gives the codes ``q[start:stop]`` (inputs
    ``start`` to ``stop``, ``[stop - start, out]``), ``zeros()`` the unpacked zero points."""

    layout: str = ""

    def __init__(self, shape, dtype, **stored: torch.Tensor) -> None:
        super().__init__(shape, dtype)
        for name, tensor in stored.items():
            self.register_buffer(name, tensor)

    def unpack_inputs(self, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def zeros(self) -> torch.Tensor:
        raise NotImplementedError

    def groups_of_inputs(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """``scales[g, o] * (q[i, o] - z[g, o])`` in float32, rounded once to the dtype, a chunk of inputs
        at a time so that the temporaries stay small."""
        out_features, in_features = self.shape
        weight = torch.empty(out_features, in_features, dtype=self.dtype, device=self.scales.device)
        zeros, scales, g_idx = self.zeros(), self.scales.to(torch.float32), self.groups_of_inputs()
        per_chunk = max(32, CHUNK_ELEMENTS // max(out_features, 1) // 32 * 32)
        for start in range(0, in_features, per_chunk):
            stop = min(start + per_chunk, in_features)
            groups = g_idx[start:stop]
            chunk = (self.unpack_inputs(start, stop) - zeros[groups]).to(torch.float32) * scales[groups]
            weight[:, start:stop] = chunk.T
        return weight


class GptqWeight(GroupedIntWeight):
    layout = "gptq"

    def __init__(self, qweight, qzeros, scales, g_idx, bits: int, zero_offset: int, dtype, name: str) -> None:
        per_word = 32 // bits
        in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
        super().__init__(
            (out_features, in_features), dtype, qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx
        )
        self.bits, self.zero_offset = bits, zero_offset
        _check_shapes(name, in_features, out_features, self.zeros(), scales, g_idx)

    def unpack_inputs(self, start, stop):
        per_word = 32 // self.bits
        return unpack_words(self.qweight[start // per_word : -(-stop // per_word)], self.bits, 0)[
            start % per_word : start % per_word + stop - start
        ]

    def zeros(self):
        unpacked = unpack_words(self.qzeros, self.bits, dim=1)[:, : self.shape[0]]
        return (unpacked + self.zero_offset) & ((1 << self.bits) - 1)

    def groups_of_inputs(self):
        return self.g_idx.long()


class AwqWeight(GroupedIntWeight):
    layout = "awq"

    def __init__(self, qweight, qzeros, scales, group_size: int, dtype, name: str) -> None:
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        super().__init__((out_features, in_features), dtype, qweight=qweight, qzeros=qzeros, scales=scales)
        self.group_size = in_features if group_size == -1 else group_size
        _check_shapes(name, in_features, out_features, self.zeros(), scales, self.groups_of_inputs())

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        values = unpack_words(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)
        return values[:, :, list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)

    def unpack_inputs(self, start, stop):
        return self._unpack(self.qweight[start:stop])

    def zeros(self):
        return self._unpack(self.qzeros)

    def groups_of_inputs(self):
        return torch.arange(self.shape[1], device=self.qweight.device) // self.group_size


class GroupedInt4Weight(int4pack.Int4Weight):
    """A 4-bit GPTQ or AWQ weight held for torch's CPU int4 kernel (``petals.formats.int4pack``): its codes
    repacked into the kernel's layout (``packed``), inputs sorted by group (``order``, where an act-order
    checkpoint's groups are a permutation of its inputs: the kernel's groups are runs of inputs, so each
    forward takes ``inputs[..., order]``; None where they already are runs), and per group its stored
    scale with ``8 - zero`` beside it (``fields`` ``[groups, out, 2]``, in the scales' dtype: the zero
    points are small integers, exact in it).

    That pairing is the kernel's: ``scale * (q - zero)`` is ``(q - 8) * scale + (8 - zero) * scale``, so a
    forward's bfloat16 scales and zeros are one conversion of ``fields`` to float32, one product and one
    rounding. Dequantizing reads the same codes and fields back, a run of rows at a time, to the same
    weights as the stored form. Held: the stored bytes, but 2 bytes per zero point where the checkpoint
    packs it in half a byte (1.08x the checkpoint's bytes in groups of 32, 1.02x in groups of 128)."""

    def __init__(self, weight: GroupedIntWeight, group_size: int, order: torch.Tensor | None) -> None:
        super().__init__(weight.shape, weight.dtype)
        self.group_size, self.layout = group_size, weight.layout
        groups = weight.shape[1] // group_size
        scales = weight.scales[:groups]
        shifted_zeros = (8 - weight.zeros()[:groups]).to(scales.dtype)
        self.register_buffer("packed", int4pack.pack(_codes(weight, order)))
        self.register_buffer("fields", torch.stack([scales, shifted_zeros], dim=-1))
        self.register_buffer("order", order)

    def scales_and_zeros(self) -> torch.Tensor:
        pairs = self.fields.to(torch.float32)
        pairs[..., 1].mul_(pairs[..., 0])
        return pairs.to(torch.bfloat16)

    def kernel_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs if self.order is None else inputs.index_select(-1, self.order)

    def dequantize(self) -> torch.Tensor:
        """``scale * (q - zero)`` in float32, rounded once to the dtype (the stored form's arithmetic), a
        run of whole tiles of rows at a time (how the codes are laid out), inputs put back in their order."""
        out_features, in_features = self.shape
        weight = torch.empty(out_features, in_features, dtype=self.dtype, device=self.packed.device)
        scales = self.fields[..., 0].T.to(torch.float32)  # [out, groups]
        zeros = 8 - self.fields[..., 1].T.to(torch.int32)
        tiles = max(1, CHUNK_ELEMENTS // in_features // int4pack.TILE_ROWS)
        for start in range(0, out_features, tiles * int4pack.TILE_ROWS):
            rows = slice(start, min(start + tiles * int4pack.TILE_ROWS, out_features))
            codes = int4pack.unpack(self.packed[rows], rows.stop - start, in_features, torch.uint8)
            grouped = codes.view(rows.stop - start, -1, self.group_size) - zeros[rows, :, None]
            values = grouped.to(torch.float32).mul_(scales[rows, :, None]).view(-1, in_features)
            if self.order is None:
                weight[rows] = values
            else:
                weight[rows].index_copy_(1, self.order.long(), values.to(self.dtype))
        return weight

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.layout} int4 for torch's CPU kernel"


def _codes(weight: GroupedIntWeight, order: torch.Tensor | None) -> torch.Tensor:
    """``weight``'s codes ``[out, in]`` as uint8, inputs in ``order`` (None: as stored), unpacked a chunk
    of inputs at a time."""
    out_features, in_features = weight.shape
    codes = torch.empty(out_features, in_features, dtype=torch.uint8, device=weight.scales.device)
    per_chunk = max(32, CHUNK_ELEMENTS // max(out_features, 1) // 32 * 32)
    for start in range(0, in_features, per_chunk):
        stop = min(start + per_chunk, in_features)
        codes[:, start:stop] = weight.unpack_inputs(start, stop).T
    return codes if order is None else codes.index_select(1, order)


def held_for_kernel(weight: GroupedIntWeight, bits: int) -> PackedWeight:
    """``weight`` as a ``GroupedInt4Weight`` where torch's int4 kernel can compute with it: 4-bit codes, a
    shape it packs, and groups of equal size (each group a run of inputs, or after sorting the inputs by
    group: act order); any other weight as it is."""
    if bits != 4:
        return weight
    out_features, in_features = weight.shape
    g_idx = weight.groups_of_inputs()
    sizes = torch.bincount(g_idx)
    group_size = in_features // max(len(sizes), 1)
    if not bool((sizes == group_size).all()) or not int4pack.packable(out_features, in_features, group_size):
        return weight
    order = torch.argsort(g_idx, stable=True)
    if torch.equal(order, torch.arange(in_features, device=order.device)):
        return GroupedInt4Weight(weight, group_size, None)
    return GroupedInt4Weight(weight, group_size, order.to(torch.int32))


def _check_shapes(
    prefix: str,
    in_features: int,
    out_features: int,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
) -> None:
    groups = int(g_idx.max()) + 1 if g_idx.numel() else 0
    if (
        g_idx.shape != (in_features,)
        or scales.shape[1] != out_features
        or zeros.shape != scales.shape
        or scales.shape[0] < groups
    ):
        raise CheckpointFormatError(
            f"{prefix}qweight unpacks to {in_features} inputs x {out_features} outputs in {groups} groups, "
            f"which its scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)} and g_idx "
            f"{tuple(g_idx.shape)} do not match (wrong bits or group_size in quantization_config?)"
        )


def _int_bits(quantization_config: dict[str, Any], method: str, supported: tuple[int, ...]) -> int:
    bits = quantization_config.get("bits", quantization_config.get("w_bit", 4))
    if bits not in supported:
        raise CheckpointFormatError(
            f"{method} with {bits} bits is not one petals reads ({', '.join(map(str, supported))})"
        )
    if quantization_config.get("dynamic"):
        raise CheckpointFormatError(
            f"{method} with per-module overrides (dynamic) is not one petals reads yet"
        )
    return bits


def _packed_linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """``"…q_proj."`` for every stored ``"…q_proj.qweight"``."""
    return sorted(
        name.removesuffix("qweight") for name in tensors if name.endswith(".qweight") or name == "qweight"
    )


def _pack_linears(
    tensors: dict[str, torch.Tensor],
    companions: tuple[str, ...],
    make: Callable[[str, dict[str, torch.Tensor]], PackedWeight],
) -> dict[str, torch.Tensor | PackedWeight]:
    linears = _packed_linears(tensors)
    packed: dict[str, torch.Tensor | PackedWeight] = {
        name: tensor
        for name, tensor in tensors.items()
        if not any(name == prefix + suffix for prefix in linears for suffix in companions)
    }
    for prefix in linears:
        missing = [prefix + s for s in companions[:3] if prefix + s not in tensors]
        if missing:
            raise CheckpointFormatError(f"{prefix}qweight has no {', '.join(missing)}")
        if (
            tensors[prefix + "qweight"].dtype != torch.int32
            or tensors[prefix + "qzeros"].dtype != torch.int32
        ):
            raise CheckpointFormatError(
                f"{prefix}qweight and qzeros must be int32, the checkpoint has {tensors[prefix + 'qweight'].dtype}"
            )
        packed[prefix + "weight"] = make(
            prefix, {s: tensors[prefix + s] for s in companions if prefix + s in tensors}
        )
    return packed


class GptqFormat(WeightFormat):
    name = "gptq"
    quant_methods = ("gptq",)

    def check(self, quantization_config):
        _int_bits(quantization_config, "gptq", (2, 4, 8))
        checkpoint_format = quantization_config.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise CheckpointFormatError(
                f"gptq checkpoint_format {checkpoint_format!r} is not one petals reads (gptq, gptq_v2)"
            )
        if quantization_config.get("lm_head"):
            raise CheckpointFormatError("gptq with a quantized lm_head is not one petals reads yet")

    def pack(self, tensors, quantization_config, dtype):
        bits = _int_bits(quantization_config, "gptq", (2, 4, 8))
        group_size = quantization_config.get("group_size", 128)
        zero_offset = 1 if quantization_config.get("checkpoint_format", "gptq") == "gptq" else 0

        def make(prefix, parts):
            g_idx = parts.get("g_idx")
            if g_idx is None:
                in_features = parts["qweight"].shape[0] * 32 // bits
                g_idx = torch.arange(in_features, dtype=torch.int32) // (
                    in_features if group_size == -1 else group_size
                )
            stored = GptqWeight(
                parts["qweight"], parts["qzeros"], parts["scales"], g_idx, bits, zero_offset, dtype, prefix
            )
            return held_for_kernel(stored, bits)

        return _pack_linears(tensors, ("qweight", "qzeros", "scales", "g_idx"), make)

    def matrix_nbytes(self, shape, quantization_config):
        bits = quantization_config.get("bits", 4)
        *lead, out_features, in_features = shape
        group_size = quantization_config.get("group_size", 128)
        groups = 1 if group_size == -1 else math.ceil(in_features / group_size)
        per_matrix = (
            in_features * out_features * bits // 8  # qweight
            + groups * math.ceil(out_features * bits / 32) * 4  # qzeros
            + groups * out_features * 2  # float16 scales
            + in_features * 4  # g_idx
        )
        return math.prod(lead) * per_matrix

    def describe(self, quantization_config):
        return f"gptq int{quantization_config.get('bits', 4)}"


class AwqFormat(WeightFormat):
    name = "awq"
    quant_methods = ("awq",)

    def check(self, quantization_config):
        _int_bits(quantization_config, "awq", (4,))
        version = str(quantization_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointFormatError(f"awq version {version!r} is not one petals reads (gemm)")
        if not quantization_config.get("zero_point", True):
            raise CheckpointFormatError("awq without zero points (zero_point: false) is not one petals reads")

    def pack(self, tensors, quantization_config, dtype):
        group_size = quantization_config.get("group_size", quantization_config.get("q_group_size", 128))
        return _pack_linears(
            tensors,
            ("qweight", "qzeros", "scales"),
            lambda prefix, parts: held_for_kernel(
                AwqWeight(parts["qweight"], parts["qzeros"], parts["scales"], group_size, dtype, prefix), 4
            ),
        )

    def matrix_nbytes(self, shape, quantization_config):
        *lead, out_features, in_features = shape
        group_size = quantization_config.get("group_size", quantization_config.get("q_group_size", 128))
        groups = 1 if group_size == -1 else math.ceil(in_features / group_size)
        per_matrix = in_features * out_features // 2 + groups * out_features // 2 + groups * out_features * 2
        return math.prod(lead) * per_matrix

    def describe(self, quantization_config):
        return "awq int4"


GPTQ = GptqFormat()
AWQ = AwqFormat()
