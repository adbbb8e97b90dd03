"""GGUF quant types dequantized in torch exactly as gguf's numpy reference does, and 4-bit GGUF matrices
held for torch's CPU int4 kernel (``petals.formats.int4pack``) without losing that exactness.

Blocks are random bytes with valid (finite) float16 scales, so that every code, sub-block scale and
bit-plane of every type is exercised; the K-quant writer of ``gguf_kquants`` is checked against gguf's
decoder too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install gguf")
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as numpy_dequantize  # noqa: E402
from gguf_kquants import quantization_error, quantize  # noqa: E402

from petals.formats import gguf_quants, int4pack  # noqa: E402
from petals.formats.gguf import GgufInt4Weight, GgufWeight, gguf_weight  # noqa: E402
from petals.formats.packed import set_dtype  # noqa: E402

FLOAT16_FIELDS = {  # where each type's float16 scales sit in a block
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.TQ2_0: (64,),  # one of the types only gguf's numpy dequantizes
}
TORCH_TYPES = sorted((qtype for qtype in FLOAT16_FIELDS if qtype != Q.TQ2_0), key=int)
FOUR_BIT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """uint8 ``[rows, bytes per row]``: random bytes, with finite float16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    count = rows * cols // block_size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, type_size), dtype=np.uint8)
    for start in FLOAT16_FIELDS.get(qtype, ()):
        halves = (rng.standard_normal(count) * scale).astype(np.float16)
        blocks[:, start : start + 2] = halves.view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)


def bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy().view(np.uint32)


@pytest.mark.parametrize("qtype", TORCH_TYPES, ids=lambda qtype: qtype.name)
def test_each_type_dequantizes_bit_for_bit_as_gguf_and_other_dtypes_round_that_once(qtype):
    assert gguf_quants.quant_type(qtype).decoder is not None  # torch's, not the fallback
    blocks = random_blocks(qtype, 48, 1024)  # 49152 values: more than one chunk
    raw = torch.from_numpy(blocks)
    expected = numpy_dequantize(blocks, qtype)

    values = gguf_quants.dequantize(raw, qtype, torch.float32, (48, 1024))
    assert np.array_equal(bits(values), expected.view(np.uint32))
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(gguf_quants.dequantize(raw, qtype, dtype, (48, 1024)), values.to(dtype))


def test_float_types_come_back_as_their_values_in_new_memory():
    values = torch.randn(4, 32)
    as_bf16_bytes = values.to(torch.bfloat16).view(torch.uint8)  # gguf's reader gives BF16 as bytes
    assert torch.equal(
        gguf_quants.dequantize(as_bf16_bytes, Q.BF16, torch.float32, (4, 32)),
        values.to(torch.bfloat16).float(),
    )
    halves = values.half()
    assert torch.equal(gguf_quants.dequantize(halves, Q.F16, torch.float32, (4, 32)), halves.float())
    copied = gguf_quants.dequantize(values, Q.F32, torch.float32, (4, 32))
    assert torch.equal(copied, values) and copied.data_ptr() != values.data_ptr()  # never the file's map


def test_a_type_without_a_torch_dequantizer_falls_back_to_gguf_by_name():
    qtype = Q.TQ2_0
    assert gguf_quants.quant_type(qtype).decoder is None
    blocks = random_blocks(qtype, 2, 1024)
    values = gguf_quants.dequantize(torch.from_numpy(blocks), qtype, torch.bfloat16, (2, 1024))
    assert torch.equal(values, torch.from_numpy(numpy_dequantize(blocks, qtype)).to(torch.bfloat16))


@pytest.mark.parametrize("qtype, bound", [(Q.Q4_K, 0.06), (Q.Q5_K, 0.03), (Q.Q6_K, 0.02)], ids=str)
def test_the_k_quant_writer_writes_blocks_gguf_decodes_close_to_the_weights(qtype, bound):
    weight = np.random.default_rng(1).standard_normal((32, 512)).astype(np.float32) * 0.02
    assert 0 < quantization_error(weight, qtype) < bound
    blocks = quantize(weight, qtype)
    assert torch.equal(
        gguf_quants.dequantize(torch.from_numpy(blocks), qtype, torch.float32, weight.shape),
        torch.from_numpy(numpy_dequantize(blocks, qtype)),
    )


# --- the int4 layout of torch's CPU kernel ---------------------------------------------------------


@pytest.mark.parametrize("rows", [16, 48, 64, 80, 192])
def test_codes_unpack_from_the_kernels_layout_exactly_also_a_run_of_tiles_at_a_time(rows):
    assert int4pack.available()
    codes = torch.randint(0, 16, (rows, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(rows))
    packed = int4pack.pack(codes.to(torch.uint8))
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
    assert torch.equal(int4pack.unpack(packed, rows, 96), codes)
    if rows > int4pack.TILE_ROWS:
        assert torch.equal(
            int4pack.unpack(packed[64:], rows - 64, 96, torch.uint8), codes[64:].to(torch.uint8)
        )


def test_the_kernel_computes_q_minus_8_times_scale_plus_zero():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 128), dtype=torch.int32, generator=generator)
    scales, zeros = torch.rand(64, 4, generator=generator), torch.randn(64, 4, generator=generator)
    weight = ((codes - 8).float().view(64, 4, 32) * scales[..., None] + zeros[..., None]).view(64, 128)
    x = torch.randn(2, 3, 128, generator=generator).to(torch.bfloat16)
    pairs = torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16)  # [groups, rows, 2]
    out = int4pack.matmul(x, int4pack.pack(codes), 32, pairs)
    expected = F.linear(x.float(), weight)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() <= 0.01 * expected.abs().max()


def test_the_kernel_is_used_only_where_it_is_fast_and_exact_enough():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert int4pack.usable(x, 32, 64, 32)
    assert not int4pack.usable(x.float(), 32, 64, 32)  # torch's float32 path is slow
    assert not int4pack.usable(x.clone().requires_grad_(), 32, 64, 32)
    assert not int4pack.usable(x, 24, 64, 32)  # rows must be a multiple of 16
    assert not int4pack.usable(x, 32, 64, 48)  # groups of 32, 64, 128 or 256 inputs


# --- 4-bit GGUF matrices held for the kernel -----------------------------------------------------


@pytest.mark.parametrize("qtype", FOUR_BIT, ids=lambda qtype: qtype.name)
@pytest.mark.parametrize("rows", [80, 192])
def test_a_4_bit_matrix_served_in_bfloat16_is_repacked_and_dequantizes_exactly(qtype, rows):
    blocks = random_blocks(qtype, rows, 512, scale=0.01)
    weight = gguf_weight(torch.from_numpy(blocks), qtype, (rows, 512), torch.bfloat16)
    assert isinstance(weight, GgufInt4Weight)
    expected = torch.from_numpy(numpy_dequantize(blocks, qtype))
    assert torch.equal(weight.dequantize(), expected.to(torch.bfloat16))
    set_dtype(weight, torch.float32)
    assert np.array_equal(bits(weight.dequantize()), bits(expected))
    # the blocks' own bytes, rearranged (Q4_K: its 6-bit sub-block scales and mins a byte each)
    assert blocks.nbytes <= weight.stored_nbytes <= 1.03 * blocks.nbytes
    assert weight.stored_nbytes == blocks.nbytes or qtype == Q.Q4_K


@pytest.mark.parametrize("qtype", FOUR_BIT, ids=lambda qtype: qtype.name)
def test_bfloat16_inputs_go_through_the_kernel_within_bfloat16_error_of_the_dense_weight(qtype):
    blocks = random_blocks(qtype, 64, 1024, scale=0.01)
    weight = gguf_weight(torch.from_numpy(blocks), qtype, (64, 1024), torch.bfloat16)
    dense = weight.dequantize()
    x = torch.randn(3, 5, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16)
    out = F.linear(x, weight, bias)  # what every nn.Linear of a block calls
    reference = F.linear(x.float(), dense.float(), bias.float())
    dense_error = (F.linear(x, dense, bias).float() - reference).abs().max()
    kernel_error = (out.float() - reference).abs().max()
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 64)
    # the kernel rounds each group's scale and zero to bfloat16 where the dense path rounds each weight:
    # the same order of error, held here to 3x the dense path's and 1% of the outputs' range
    assert kernel_error <= max(3 * dense_error, 0.01 * reference.abs().max())
    assert torch.equal(weight.dequantize(), dense)  # the call left the stored fields as they were


@pytest.mark.parametrize("qtype", FOUR_BIT, ids=lambda qtype: qtype.name)
def test_the_kernels_scales_and_zeros_are_the_types_own_rounded_once_to_bfloat16(qtype):
    blocks = random_blocks(qtype, 80, 512, scale=0.01)
    weight = gguf_weight(torch.from_numpy(blocks), qtype, (80, 512), torch.bfloat16)
    four_bit = gguf_quants.four_bit_type(qtype)
    by_block = torch.from_numpy(blocks).reshape(-1, gguf_quants.quant_type(qtype).type_size)
    scales, zeros = (fields.reshape(80, -1).T for fields in four_bit.kernel_scales(*four_bit.split(by_block)))
    expected = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)  # [in / 32, out, 2]
    pairs = weight.scales_and_zeros()
    assert pairs.is_contiguous() and torch.equal(pairs, expected)


def test_float32_inputs_large_batches_and_inputs_needing_gradients_see_the_dequantized_weight():
    blocks = random_blocks(Q.Q4_K, 32, 256, scale=0.01)
    weight = gguf_weight(torch.from_numpy(blocks), Q.Q4_K, (32, 256), torch.bfloat16)
    x = torch.randn(2, 256)
    assert torch.equal(F.linear(x, weight), F.linear(x, weight.dequantize().float()))
    many = torch.randn(int4pack.MAX_ROWS + 1, 256).to(torch.bfloat16)  # the kernel is slower there
    assert torch.equal(F.linear(many, weight), F.linear(many, weight.dequantize()))
    trained = x.to(torch.bfloat16).requires_grad_()
    out = F.linear(trained, weight)
    assert torch.equal(out, F.linear(trained, weight.dequantize()))
    out.sum().backward()
    assert trained.grad is not None


def test_matrices_the_kernel_cannot_hold_stay_in_their_gguf_blocks():
    def held(qtype, shape, dtype=torch.bfloat16):
        blocks = random_blocks(qtype, *shape)
        return type(gguf_weight(torch.from_numpy(blocks), qtype, shape, dtype))

    assert held(Q.Q4_0, (24, 64)) is GgufWeight  # rows not a multiple of 16
    assert held(Q.Q4_0, (32, 64), torch.float32) is GgufWeight  # float32: dequantized per forward anyway
    assert held(Q.Q6_K, (32, 256)) is GgufWeight  # not a 4-bit type
    assert held(Q.Q4_K, (32, 256)) is GgufInt4Weight
