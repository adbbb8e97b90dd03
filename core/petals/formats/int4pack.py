"""Torch's CPU int4 matmul: 4-bit codes in the layout of ``aten._weight_int4pack_mm_for_cpu``.

The kernel computes ``x @ w.T`` for a bfloat16 ``x`` ``[M, K]`` and a weight ``w`` ``[N, K]`` stored as
4-bit codes ``q`` with a scale and a zero per group of ``group_size`` inputs: ``w = (q - 8) * scale +
zero``, the pairs given as one bfloat16 ``[K / group_size, N, 2]``. At batch 1 it is faster than a
bfloat16 ``F.linear`` of the dense weight (it reads a quarter of the bytes); for float32 inputs torch
takes a slow path, so callers dequantize those instead. A format whose weights are 4-bit codes with
per-group scales (GGUF Q4_0/Q4_1/Q4_K, GPTQ, AWQ) is an ``Int4Weight``: its codes repacked once at load
(``pack``), its own compact scale fields kept exactly, and the kernel's pairs built from them per
forward (``Int4Weight.scales_and_zeros``).

The packed layout is torch's (``aten._convert_weight_to_int4pack_for_cpu``): rows in tiles of 64, each
tile stored input by input, 32 bytes per input, byte ``j`` holding row ``j`` in its low nibble and row
``j + 32`` in its high one; the last tile of fewer than 64 rows holds rows ``2j`` and ``2j + 1``. ``unpack``
inverts it, so a repacked weight still dequantizes exactly; ``available`` checks the layout on a probe
before anything relies on it.
"""

from __future__ import annotations

import functools
import sys

import torch

from petals.formats.packed import PackedWeight

GROUP_SIZES = (32, 64, 128, 256)
TILE_ROWS = 64  # rows per tile of the packed layout
ROW_MULTIPLE = 16  # the kernel's packing needs N divisible by this
PACK_VALUES = 1 << 22  # codes packed at a time
# Above this many input rows a caller holding only packed weights is faster dequantizing them and
# multiplying densely (GGUF Q4_0/Q4_K, 1024x1024 and 4096x4096: the kernel's time grows with the rows,
# the dequantization's does not; they crossed between 128 and 256 rows)
MAX_ROWS = 128


class Int4Weight(PackedWeight):
    """A weight ``[out, in]`` held for the kernel: ``packed``, its codes in the kernel's layout, in groups
    of ``group_size`` inputs, and whatever exact fields its format keeps (subclasses).

    ``linear`` is the one rule every such format follows: bfloat16 inputs of at most ``MAX_ROWS`` rows
    on CPU, needing no gradient, go through the kernel with the pairs ``scales_and_zeros`` builds for
    that call (and the inputs in the codes' order, ``kernel_inputs``); anything else (float32, a
    gradient, another device, a large batch) sees the weight dequantized, as the format dequantizes it."""

    group_size: int
    kernel = True

    def scales_and_zeros(self) -> torch.Tensor:
        """The kernel's bfloat16 ``[in / group_size, out, 2]`` (contiguous): each group's scale and zero."""
        raise NotImplementedError

    def kernel_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` in the order of the codes' inputs (a permutation for act-order GPTQ)."""
        return inputs

    def computes(self, inputs: torch.Tensor) -> bool:
        """Whether ``linear`` takes the kernel for ``inputs``."""
        out_features, in_features = self.shape
        return inputs.numel() <= MAX_ROWS * in_features and usable(
            inputs, out_features, in_features, self.group_size
        )

    def linear(self, inputs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.computes(inputs):
            return super().linear(inputs, bias)
        outputs = matmul(self.kernel_inputs(inputs), self.packed, self.group_size, self.scales_and_zeros())
        return outputs if bias is None else outputs + bias


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes ``[N, K]`` in 0..15 (any integer dtype) → the kernel's packed uint8 ``[N, K / 2]``.

    Packed a run of whole tiles at a time (runs of 64 rows pack into consecutive bytes), so that the
    int32 copy the packing takes stays small whatever the matrix."""
    n, k = codes.shape
    step = max(TILE_ROWS, PACK_VALUES // max(k, 1) // TILE_ROWS * TILE_ROWS)
    runs = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes[start : start + step].to(torch.int32).contiguous(), 1
        )
        for start in range(0, n, step)
    ]
    return torch.cat([run.reshape(-1) for run in runs]).reshape(n, k // 2)


def unpack(packed: torch.Tensor, n: int, k: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """The codes ``[n, k]`` that ``pack`` packed into ``packed`` (on its device), as ``dtype``. Rows
    ``start:stop`` of a packed ``[N, K / 2]`` with ``start`` a multiple of 64 (and ``stop`` one too, or
    ``N``) are themselves the packed rows ``start:stop``: a caller can unpack a run of rows at a time."""
    flat = packed.reshape(-1)
    full = n // TILE_ROWS * TILE_ROWS
    tiles = flat[: full * k // 2].reshape(-1, k, TILE_ROWS // 2)  # [tiles, input, byte]
    tiled = torch.cat([tiles & 0x0F, tiles >> 4], dim=-1).transpose(1, 2)  # [tiles, row in tile, input]
    rest = flat[full * k // 2 :].reshape(k, -1)  # [input, byte]: rows 2j and 2j + 1
    last = torch.stack([rest & 0x0F, rest >> 4], dim=-1).reshape(k, n - full).T
    codes = torch.empty(n, k, dtype=dtype, device=packed.device)
    codes[:full].view(-1, TILE_ROWS, k).copy_(tiled)
    codes[full:] = last
    return codes


def matmul(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``x @ w.T`` in bfloat16 for ``w = (q - 8) * scale + zero``, ``scales_and_zeros`` the bfloat16
    ``[K / group_size, N, 2]`` pairs (the kernel reads them contiguous, whatever their strides: checked).
    ``x`` is bfloat16 ``[..., K]``; check ``usable``."""
    if not scales_and_zeros.is_contiguous():
        raise ValueError("the int4 kernel reads its scales and zeros as a contiguous tensor")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, scales_and_zeros)
    return out.reshape(*x.shape[:-1], -1)


def scales_without_zeros(scales: torch.Tensor) -> torch.Tensor:
    """The kernel's pairs ``[*scales.shape, 2]`` for groups whose zero is 0 (GGUF Q4_0): each scale
    rounded to bfloat16 in the low half of a 32-bit word, 0 in the high half (little-endian CPUs), by
    widening the bfloat16 bits, which is faster than a strided write beside a fill. Rounded through
    float32 (exact from float16): torch's direct float16 to bfloat16 conversion is 2x slower."""
    halves = scales.to(torch.float32).to(torch.bfloat16).view(torch.uint16).to(torch.int32)
    return halves.view(torch.bfloat16).view(*scales.shape, 2)


def usable(x: torch.Tensor, n: int, k: int, group_size: int) -> bool:
    """Whether ``matmul`` computes ``x`` with a weight ``[n, k]`` in groups of ``group_size`` fast: a
    bfloat16 input on CPU needing no gradient, shapes the kernel takes, and torch's layout as ``unpack``
    reads it."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not (x.requires_grad and torch.is_grad_enabled())
        and packable(n, k, group_size)
    )


def packable(n: int, k: int, group_size: int) -> bool:
    """Whether a weight ``[n, k]`` in groups of ``group_size`` can be held packed for the kernel."""
    return group_size in GROUP_SIZES and n % ROW_MULTIPLE == 0 and k % group_size == 0 and available()


@functools.cache
def available() -> bool:
    """Whether this torch has the CPU int4 kernel and packs as ``unpack`` reads (checked once on random
    codes, a full tile and a partial one), on a little-endian CPU (``scales_without_zeros``): a torch
    that packs otherwise is not used, not misread."""
    try:
        probe = torch.randint(
            0, 16, (TILE_ROWS + 48, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0)
        )
        return torch.equal(unpack(pack(probe), *probe.shape), probe) and sys.byteorder == "little"
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
