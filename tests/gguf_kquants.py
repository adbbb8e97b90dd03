"""Quantizing float weights into GGUF K-quant blocks (Q4_K, Q5_K, Q6_K), for test files.

``gguf`` (the package) decodes K-quants but cannot write them, and published K-quant files are large.
This writes valid blocks in llama.cpp's layout (``block_q4_K``, ``block_q5_K``, ``block_q6_K`` in
ggml-common.h) with plain round-to-nearest: each sub-block's scale (and min) from its own range, the
sub-block scales quantized against the super-block's float16 ``d`` (and ``dmin``). llama.cpp's
quantizer searches scales more cleverly; any valid blocks do for tests, and ``gguf.quants.dequantize``
decodes these close to the input (``quantization_error``).

    blocks = quantize(weight, GGMLQuantizationType.Q4_K)   # float [rows, cols % 256 == 0] -> uint8
    writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.Q4_K)
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType


def quantize(weight: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``weight`` ``[..., cols]`` (``cols`` a multiple of 256) → uint8 blocks ``[..., bytes per row]``."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if weight.shape[-1] % block_size:
        raise ValueError(
            f"{qtype.name} needs rows of whole {block_size}-value blocks, not {weight.shape[-1]}"
        )
    blocks = weight.astype(np.float32).reshape(-1, block_size)
    encoded = QUANTIZERS[qtype](blocks)
    assert encoded.shape == (len(blocks), type_size)
    return encoded.reshape(*weight.shape[:-1], -1)


def quantization_error(weight: np.ndarray, qtype: GGMLQuantizationType) -> float:
    """Largest error of ``weight`` quantized and decoded by gguf, relative to its largest value."""
    from gguf.quants import dequantize

    decoded = dequantize(quantize(weight, qtype), qtype).reshape(weight.shape)
    return float(np.abs(decoded - weight).max() / np.abs(weight).max())


def _fp16(values: np.ndarray) -> np.ndarray:
    """float16 values as their two bytes each, ``[n, 2]``."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _affine(sub_blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's sub-block encoding ``x ~ d * sc * q - dmin * m``: ``sub_blocks`` ``[n, 8, 32]`` →
    float16 ``d`` and ``dmin`` ``[n]``, 6-bit ``sc`` and ``m`` ``[n, 8]``, codes ``q`` in 0..levels
    ``[n, 8, 32]``."""
    low = np.minimum(sub_blocks.min(axis=-1), 0)  # the offset is subtracted: a min above 0 is 0
    scales = (sub_blocks.max(axis=-1) - low) / levels
    d = (scales.max(axis=-1) / 63).astype(np.float16)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16)
    sc = _ratio(scales, d, 63)
    m = _ratio(-low, dmin, 63)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = _ratio(sub_blocks + offset[..., None], step[..., None], levels)
    return d, dmin, sc, m, q


def _ratio(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """``round(values / unit)`` clipped to 0..top, 0 where ``unit`` is 0."""
    unit = np.broadcast_to(
        np.asarray(unit, dtype=np.float32).reshape(unit.shape + (1,) * (values.ndim - unit.ndim)),
        values.shape,
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(unit > 0, np.rint(values / unit), 0)
    return np.clip(ratio, 0, top).astype(np.uint8)


def _scales_and_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins → Q4_K/Q5_K's 12 bytes: bytes 0-3 scales 0-3 (their top bits the top
    two bits of scales 4-7), 4-7 mins 0-3 (likewise for mins 4-7), 8-11 the low nibbles of scales 4-7
    and (high nibble) mins 4-7."""
    packed = np.empty((len(sc), 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return packed


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes ``[n, 256]`` → 128 bytes: of each 64 values, the first 32 in low nibbles, the next in high."""
    runs = (q & 0x0F).reshape(len(q), 4, 2, 32)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(len(q), 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(blocks.reshape(-1, 8, 32), 15)
    return np.concatenate(
        [_fp16(d), _fp16(dmin), _scales_and_mins(sc, m), _low_nibbles(q.reshape(-1, QK_K))], axis=1
    )


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(blocks.reshape(-1, 8, 32), 31)
    high = (q >> 4).astype(np.uint8)  # [n, 8, 32]: sub-block j's fifth bits go to bit j of bytes 0-31
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate(
        [_fp16(d), _fp16(dmin), _scales_and_mins(sc, m), qh, _low_nibbles(q.reshape(-1, QK_K))], axis=1
    )


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Sixteen sub-blocks of 16, each ``x ~ d * sc * (q - 32)`` with int8 ``sc``: ``ql`` the low nibbles
    (per 128 values: bytes 0-63 hold values 0-63 low and 64-127 high), ``qh`` the top two bits (per 128
    values: byte ``l``'s bits ``2s`` hold value ``32 s + l``), the 16 scales, then ``d``."""
    n = len(blocks)
    sub_blocks = blocks.reshape(n, 16, 16)
    scales = np.abs(sub_blocks).max(axis=-1) / 31
    d = (scales.max(axis=-1) / 127).astype(np.float16)
    sc = _ratio(scales, d, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(sub_blocks / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = ((q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)).reshape(n, 128)
    top = (q >> 4).reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(top, axis=2).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d)], axis=1)


QUANTIZERS = {
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
