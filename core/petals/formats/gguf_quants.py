"""GGUF quant types as data: block size and bytes per block (gguf's ``GGML_QUANT_SIZES``), and one torch
decoder per type turning blocks (uint8 ``[blocks, bytes per block]``) into small integer codes and
float32 scales (and offsets) per group of values, ``values = scales * codes + offsets``: vectorised, on
whatever device the blocks are, no numpy.

Each decoder computes what gguf's numpy reference (``gguf.quants``, a transcription of the GGML C library's
``dequantize_row_*``) computes, operation for operation in float32, so the values are bit-identical to
it; a dtype other than float32 is that result rounded once. Servers dequantize per forward with these
and ``--weights dequantized`` at load with the same ones, so both compute the same weights. Types without
a decoder here (the ternary, IQ1-IQ3 and FP4 types) fall back to gguf's numpy, by name.

The layouts, per block (``d``, ``dmin``, ``m``: float16; ``QK_K`` = 256 values per super-block):
Q4_0 ``d, 16 bytes of nibbles`` (low nibbles values 0-15, high 16-31), Q4_1 ``d, m, nibbles``,
Q5_0/Q5_1 the same with a 32-bit word of fifth bits, Q8_0 ``d, 32 int8``; K-quants cut a super-block
into sub-blocks whose scales (and mins) are integers scaled by ``d`` (and ``dmin``): Q2_K 16 x 16
(4-bit scale and min per byte), Q3_K 16 x 16 (6-bit signed scales in 12 bytes, a high-bit mask),
Q4_K/Q5_K 8 x 32 (6-bit scales and mins in 12 bytes), Q6_K 16 x 16 (int8 scales); IQ4_NL/IQ4_XS map
nibbles through a fixed 16-value table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16, 28: torch.float64}
INTEGER_TYPES = (24, 25, 26, 27)  # I8, I16, I32, I64
# Values dequantized at a time on CPU: torch's parallel grain, so each operation runs on the calling
# thread. Larger chunks were up to 2x faster on an idle machine, but their multi-threaded operations
# stalled on a busy one (medians 2-30x slower); a pool of threads sharing small chunks gained nothing
# (dispatching holds the GIL). Other devices take large chunks: there each operation is a kernel launch.
CHUNK_VALUES = 1 << 15
DEVICE_CHUNK_VALUES = 1 << 24
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

Blocks = torch.Tensor  # uint8 [blocks, bytes per block]


def is_quantized(qtype: int) -> bool:
    """Whether ``qtype`` is a block format (kept packed by a server) rather than plain numbers."""
    return int(qtype) not in FLOAT_TYPES and int(qtype) not in INTEGER_TYPES


# --- field readers ---------------------------------------------------------------------------------


def half16(blocks: Blocks, start: int) -> torch.Tensor:
    """The float16 at bytes ``start:start + 2`` of each block, ``[blocks, 1]``, a view (every type's blocks
    and float16 fields are 2-byte aligned)."""
    return blocks.view(torch.float16)[:, start // 2 : start // 2 + 1]


def half(blocks: Blocks, start: int) -> torch.Tensor:
    """``half16`` as float32."""
    return half16(blocks, start).to(torch.float32)


def shifted(data: torch.Tensor, shifts: tuple[int, ...], dim: int) -> torch.Tensor:
    """``data >> shift`` for each shift, the shifts along a new dimension ``dim`` (gguf's broadcasts;
    shifts by a scalar are torch's fast path, a broadcast tensor of shifts is not)."""
    return torch.stack([data >> shift if shift else data for shift in shifts], dim=dim)


def low_then_high_nibbles(data: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes → ``[..., 2n]`` values: every byte's low nibble, then every byte's high one."""
    return (shifted(data, (0, 4), -2) & 0x0F).flatten(-2)


def bits(data: torch.Tensor) -> torch.Tensor:
    """``[..., bytes]`` → ``[..., bytes, 8]``: every byte's bits, lowest first (one table lookup: eight
    shifts cost more)."""
    return lookup(_bit_table(data.device), data)


def lookup(table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``table[indices]`` for small unsigned ``indices`` (``index_select`` with int32 indices is ~10x
    faster than advanced indexing with int64 ones)."""
    found = torch.index_select(table, 0, indices.reshape(-1).to(torch.int32))
    return found.reshape(*indices.shape, *table.shape[1:])


@functools.cache
def _bit_table(device: torch.device) -> torch.Tensor:
    return ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).to(torch.uint8).to(device)


@functools.cache
def _iq4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.int8, device=device)


def k_scales_and_mins(scales: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes → the eight 6-bit scales and eight 6-bit mins (uint8 ``[blocks, 8]``): bytes
    0-3 hold scales 0-3 (and the top bits of scales 4-7), 4-7 the mins 0-3 (and the top bits of mins
    4-7), 8-11 the low four bits of scales (low nibble) and mins (high nibble) 4-7."""
    low, mid, high = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc, mins


# --- each type: float32 scales (and offsets) per group of values, and the values' integer codes -----

Fields = tuple[torch.Tensor, torch.Tensor | None]  # float32 scales, offsets (None: none) [blocks, groups]


def combine(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, out: torch.Tensor
) -> None:
    """``out = scales * codes + offsets`` in float32: ``codes`` small integers ``[blocks, groups, values
    per group]`` (uint8 or int8), ``scales`` and ``offsets`` ``[blocks, groups]``, ``out`` float32
    ``[blocks, groups * values per group]``. gguf's numpy computes every type's values as this one
    product in float32 (plus, for some, one addition or subtraction), so both round alike."""
    grouped = out.view(codes.shape)
    torch.mul(codes, scales.unsqueeze(-1), out=grouped)  # the codes promote to float32
    if offsets is not None:
        grouped.add_(offsets.unsqueeze(-1))


def _fifth_bits(blocks: Blocks, start: int) -> torch.Tensor:
    """Q5_0/Q5_1's little-endian 32-bit word of fifth bits → ``[blocks, 32]``: value ``i``'s at ``i``."""
    return bits(blocks[:, start : start + 4]).flatten(-2)


def _bit_planes(data: torch.Tensor) -> torch.Tensor:
    """K-quants' high-bit masks: ``[blocks, 32]`` bytes → ``[blocks, 8, 32]``, plane ``j`` bit ``j`` of each."""
    return bits(data).transpose(-1, -2)


def _d(blocks: Blocks) -> Fields:
    return half(blocks, 0), None


def _d_m(blocks: Blocks) -> Fields:
    return half(blocks, 0), half(blocks, 2)


def _q5_0_codes(blocks: Blocks) -> torch.Tensor:
    codes = low_then_high_nibbles(blocks[:, 6:]) | (_fifth_bits(blocks, 2) << 4)
    return (codes.view(torch.int8) - 16).unsqueeze(1)


def _q5_1_codes(blocks: Blocks) -> torch.Tensor:
    return (low_then_high_nibbles(blocks[:, 8:]) | (_fifth_bits(blocks, 4) << 4)).unsqueeze(1)


def _q8_0_codes(blocks: Blocks) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).unsqueeze(1)


def _q2_k_fields(blocks: Blocks) -> Fields:
    scales = blocks[:, :16]
    dl = half(blocks, 80) * (scales & 0x0F).to(torch.float32)
    ml = half(blocks, 82) * (scales >> 4).to(torch.float32)
    return dl, -ml  # gguf subtracts the min: adding its negation rounds alike


def _q2_k_codes(blocks: Blocks) -> torch.Tensor:
    codes = shifted(blocks[:, 16:80].reshape(-1, 2, 32), (0, 2, 4, 6), 2) & 3  # [blocks, 2, 4, 32]
    return codes.reshape(-1, 16, 16)


def _q3_k_fields(blocks: Blocks) -> Fields:
    packed = blocks[:, 96:108]
    low = (shifted(packed[:, :8], (0, 4), 1) & 0x0F).flatten(1)  # [blocks, 16]
    high = (shifted(packed[:, 8:12], (0, 2, 4, 6), 1) & 3).flatten(1)
    return half(blocks, 108) * ((low | (high << 4)).to(torch.float32) - 32), None


def _q3_k_codes(blocks: Blocks) -> torch.Tensor:
    codes = (shifted(blocks[:, 32:96].reshape(-1, 2, 32), (0, 2, 4, 6), 2) & 3).reshape(-1, 16, 16)
    high_bit = _bit_planes(blocks[:, :32]).reshape(-1, 16, 16)
    return codes.view(torch.int8) - ((high_bit ^ 1) << 2).view(torch.int8)  # a set bit: no offset


def _k_fields(blocks: Blocks) -> Fields:
    """Q4_K/Q5_K's header: sub-block scales ``d * sc`` and offsets ``-(dmin * m)``."""
    return _k_values(*_k_parts(blocks))


def _q5_k_codes(blocks: Blocks) -> torch.Tensor:
    low = low_then_high_nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return low | (_bit_planes(blocks[:, 16:48]) << 4)


def _q6_k_fields(blocks: Blocks) -> Fields:
    return half(blocks, 208) * blocks[:, 192:208].view(torch.int8).to(torch.float32), None


def _q6_k_codes(blocks: Blocks) -> torch.Tensor:
    low = low_then_high_nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    high = (shifted(blocks[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 2) & 3).reshape(-1, 8, 32)
    return ((low | (high << 4)).view(torch.int8) - 32).reshape(-1, 16, 16)


def _iq4(codes: torch.Tensor) -> torch.Tensor:
    """IQ4's nibbles → their int8 values in the fixed non-linear table."""
    return lookup(_iq4_table(codes.device), codes)


def _iq4_nl_codes(blocks: Blocks) -> torch.Tensor:
    return _iq4(low_then_high_nibbles(blocks[:, 2:])).unsqueeze(1)


def _iq4_xs_fields(blocks: Blocks) -> Fields:
    scales_high = blocks[:, 2].to(torch.int32) | (blocks[:, 3].to(torch.int32) << 8)  # little-endian u16
    high = (shifted(scales_high.unsqueeze(-1), tuple(range(0, 16, 2)), 1).squeeze(-1) & 3).to(torch.uint8)
    low = (shifted(blocks[:, 4:8], (0, 4), 2) & 0x0F).flatten(1)  # sub-block 2j: byte j's low nibble
    return half(blocks, 0) * ((low | (high << 4)).to(torch.float32) - 32), None


def _iq4_xs_codes(blocks: Blocks) -> torch.Tensor:
    return _iq4(low_then_high_nibbles(blocks[:, 8:].reshape(-1, 8, 16)))


# --- 4-bit types: codes 0..15 in runs of 32 values, a scale (and an offset) per run ---------------


@dataclass(frozen=True)
class FourBitType:
    """A type whose blocks are a header of scales (``header_bytes``) then 4-bit codes, a byte holding
    value ``i`` of a run in its low nibble and value ``i + nibble_run`` in its high one; every 32 values
    share a scale and an offset, and a value is ``scale * (code + code_offset) + offset``.

    ``split`` reads a header's exact parts (float16 factors, integer sub-block scales; each
    ``[blocks, 1 or groups]``), ``values`` computes from them the float32 scales and offsets as gguf
    does, broadcasting over whatever layout the parts are in. torch's int4 kernel
    (``petals.formats.int4pack``) takes the codes and, per 32 values, a scale and a zero
    (``kernel_scales``)."""

    header_bytes: int
    nibble_run: int
    code_offset: int
    split: Callable[[Blocks], tuple[torch.Tensor, ...]]
    values: Callable[..., Fields]

    def nibbles(self, blocks: Blocks) -> torch.Tensor:
        """uint8 codes 0..15 ``[n, values per block]`` in value order."""
        qs = blocks[:, self.header_bytes :]
        return low_then_high_nibbles(qs.reshape(len(blocks), -1, self.nibble_run)).flatten(1)

    def grouped(self, nibbles: torch.Tensor, blocks: int) -> torch.Tensor:
        """``nibbles`` (any integer dtype) as the codes ``combine`` takes: ``[blocks, groups, 32]``."""
        grouped = nibbles.reshape(blocks, -1, 32)
        if self.code_offset:
            grouped = grouped.to(torch.int8) + self.code_offset  # as gguf: int8 codes, then float32
        return grouped

    def fields(self, blocks: Blocks) -> Fields:
        return self.values(*self.split(blocks))

    def codes(self, blocks: Blocks) -> torch.Tensor:
        return self.grouped(self.nibbles(blocks), len(blocks))

    def kernel_scales(self, *parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per 32 values, float32 (in the parts' layout): ``scale`` and ``zero`` with ``value = (code - 8) *
        scale + zero``, the int4 kernel's form (``zero = scale * (8 + code_offset) + offset``)."""
        scales, offsets = self.values(*parts)
        if offsets is None:
            return scales, scales * (8 + self.code_offset)
        return scales, offsets.add_(scales, alpha=8 + self.code_offset)  # offsets are ours to overwrite


def _d_part(headers: Blocks) -> tuple[torch.Tensor]:
    return (half16(headers, 0),)


def _d_m_parts(headers: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    return half16(headers, 0), half16(headers, 2)


def _k_parts(headers: Blocks) -> tuple[torch.Tensor, ...]:
    return (half16(headers, 0), half16(headers, 2), *k_scales_and_mins(headers[:, 4:16]))


def _scale_only(d: torch.Tensor) -> Fields:
    return d.to(torch.float32), None


def _scale_and_min(d: torch.Tensor, m: torch.Tensor) -> Fields:
    return d.to(torch.float32), m.to(torch.float32, copy=True)  # new memory: kernel_scales writes it


def _k_values(d, dmin, sc, mins) -> Fields:
    """Sub-block scale ``d * sc``, offset ``-(dmin * m)`` (gguf subtracts the min; adding its negation
    rounds alike)."""
    scales = torch.mul(sc, d.to(torch.float32))  # the integers promote to float32 exactly, as in gguf
    return scales, torch.mul(mins, dmin.to(torch.float32)).neg_()


FOUR_BIT_TYPES: dict[GGMLQuantizationType, FourBitType] = {
    GGMLQuantizationType.Q4_0: FourBitType(2, 16, -8, _d_part, _scale_only),
    GGMLQuantizationType.Q4_1: FourBitType(4, 16, 0, _d_m_parts, _scale_and_min),
    GGMLQuantizationType.Q4_K: FourBitType(16, 32, 0, _k_parts, _k_values),
}


def four_bit_type(qtype: int) -> FourBitType | None:
    """``qtype``'s 4-bit layout, None for a type that is not one (Q4_0, Q4_1 and Q4_K are)."""
    return FOUR_BIT_TYPES.get(int(qtype))


@dataclass(frozen=True)
class Decoder:
    """How a type's blocks decode: ``fields`` gives the float32 scales (and offsets) of their ``groups``
    groups each, ``codes`` the values' integer codes ``[blocks, groups, values per group]``; the values
    are ``combine``'s. Kept apart so that a chunk's fields are computed once for more blocks than the
    values are at a time (a type's fields take as many operations as its values, for far fewer numbers)."""

    groups: int
    fields: Callable[[Blocks], Fields]
    codes: Callable[[Blocks], torch.Tensor]


def _four_bit(qtype: GGMLQuantizationType, groups: int) -> Decoder:
    kind = FOUR_BIT_TYPES[qtype]
    return Decoder(groups, kind.fields, kind.codes)


DECODERS: dict[GGMLQuantizationType, Decoder] = {
    GGMLQuantizationType.Q4_0: _four_bit(GGMLQuantizationType.Q4_0, 1),
    GGMLQuantizationType.Q4_1: _four_bit(GGMLQuantizationType.Q4_1, 1),
    GGMLQuantizationType.Q4_K: _four_bit(GGMLQuantizationType.Q4_K, 8),
    GGMLQuantizationType.Q5_0: Decoder(1, _d, _q5_0_codes),
    GGMLQuantizationType.Q5_1: Decoder(1, _d_m, _q5_1_codes),
    GGMLQuantizationType.Q8_0: Decoder(1, _d, _q8_0_codes),
    GGMLQuantizationType.Q2_K: Decoder(16, _q2_k_fields, _q2_k_codes),
    GGMLQuantizationType.Q3_K: Decoder(16, _q3_k_fields, _q3_k_codes),
    GGMLQuantizationType.Q5_K: Decoder(8, _k_fields, _q5_k_codes),
    GGMLQuantizationType.Q6_K: Decoder(16, _q6_k_fields, _q6_k_codes),
    GGMLQuantizationType.IQ4_NL: Decoder(1, _d, _iq4_nl_codes),
    GGMLQuantizationType.IQ4_XS: Decoder(8, _iq4_xs_fields, _iq4_xs_codes),
}
assert QK_K == 256, "the K-quant decoders above are written for 256-value super-blocks"


@dataclass(frozen=True)
class QuantType:
    """One GGUF type: ``block_size`` values stored in ``type_size`` bytes; ``decoder`` None where only
    gguf's numpy dequantizes it (or for plain numbers: ``FLOAT_TYPES``)."""

    name: str
    block_size: int
    type_size: int
    decoder: Decoder | None

    def values_into(self, blocks: Blocks, out: torch.Tensor) -> None:
        """uint8 ``[n, type_size]`` → ``out`` ``[n, block_size]`` (on the blocks' device), computed in
        float32 and rounded once to ``out``'s dtype: the fields of all ``n`` blocks at once, the values a
        chunk at a time."""
        if self.decoder is None:
            from gguf.quants import dequantize as numpy_dequantize

            values = numpy_dequantize(blocks.cpu().numpy(), GGMLQuantizationType[self.name])
            out.copy_(torch.from_numpy(np.ascontiguousarray(values)).reshape(out.shape))
            return
        scales, offsets = self.decoder.fields(blocks)
        step = max(1, chunk_values(blocks.device) // self.block_size)
        scratch = None if out.dtype == torch.float32 else out.new_empty(out[:step].shape, dtype=torch.float32)
        for start in range(0, len(blocks), step):
            rows = slice(start, start + step)
            codes = self.decoder.codes(blocks[rows])
            target = out[rows] if scratch is None else scratch[: len(codes)]
            combine(codes, scales[rows], None if offsets is None else offsets[rows], target)
            if scratch is not None:
                out[rows] = target

    def blocks_per_chunk(self, device: torch.device) -> int:
        """Blocks whose fields are computed at once: as many numbers as values are at a time."""
        groups = self.decoder.groups if self.decoder is not None else 1
        return max(1, chunk_values(device) // groups)


@functools.cache
def quant_type(qtype: int) -> QuantType:
    """The type ``qtype`` (gguf's ``GGMLQuantizationType`` number); ``ValueError`` for one gguf lacks."""
    kind = GGMLQuantizationType(int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    return QuantType(kind.name, block_size, type_size, DECODERS.get(kind))


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` (a GGUF tensor's data: uint8 rows of blocks, or the values of a type gguf's reader gives
    typed) → ``shape`` in ``dtype``, computed in float32 and rounded once to ``dtype``; new memory."""
    qtype = int(qtype)
    if qtype in FLOAT_TYPES and raw.dtype == torch.uint8:  # BF16 (gguf's reader gives its bytes)
        raw = raw.contiguous().view(FLOAT_TYPES[qtype])
    if raw.dtype != torch.uint8 or qtype in INTEGER_TYPES:  # a copy, never the file's memory map
        return raw.reshape(shape).to(torch.float32, copy=True).to(dtype)
    kind = quant_type(qtype)
    blocks = raw.reshape(-1, kind.type_size)
    values = torch.empty(len(blocks), kind.block_size, dtype=dtype, device=raw.device)
    step = kind.blocks_per_chunk(raw.device)
    for start in range(0, len(blocks), step):
        kind.values_into(blocks[start : start + step], values[start : start + step])
    return values.reshape(shape)


def chunk_values(device: torch.device) -> int:
    """How many numbers an operation takes at a time on ``device``."""
    return CHUNK_VALUES if device.type == "cpu" else DEVICE_CHUNK_VALUES


def in_chunks(values: torch.Tensor, step: int, fill: Callable[..., None], *sources: torch.Tensor) -> None:
    """``fill(*(source[rows] for source in sources), out)`` for each chunk of ``step`` rows of ``values``:
    float32 straight into ``values``, another dtype through one float32 scratch chunk, rounded once."""
    scratch = None
    if values.dtype != torch.float32:
        scratch = values.new_empty(values[:step].shape, dtype=torch.float32)
    for start in range(0, len(values), step):
        rows = slice(start, start + step)
        parts = [source[rows] for source in sources]
        if scratch is None:
            fill(*parts, values[rows])
        else:
            out = scratch[: len(parts[0])]
            fill(*parts, out)
            values[rows] = out
