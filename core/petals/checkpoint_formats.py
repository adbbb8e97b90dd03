"""How a published checkpoint stores its weights, and how a block's tensors are read back as plain ones.

A quantized release names its format in config.json's ``quantization_config.quant_method``.
``FORMATS`` maps each method petals reads to a ``CheckpointFormat``, whose ``dequantize`` turns one
block's stored tensors (weights and their scales, under the checkpoint's names) into floating-point
weights of the serving dtype, on CPU, at load. The block itself is then built and served as for an
unquantized checkpoint (``--quant_type`` quantizes those weights again, if asked). On an
accelerator too the weights stay dequantized: no format's own kernels are used, and the server's
log line (``dequantized_note``) and ``petals health`` (``ServerInfo.dequantized_from``) say so, for a
GGUF file too (read by ``petals.gguf_checkpoint``, named here with its quant types). A method not in
the table is refused by name; a new one is a row here and its tests.

What is ours and what is transformers': FP8 block scaling is a multiplication written here; MXFP4
uses transformers' own ``convert_moe_packed_tensors``; GPTQ and AWQ unpacking is written by hand
from the formats' specifications, because transformers reads them only through gptqmodel/autoawq
kernels, which petals does not depend on (each function's docstring gives its layout).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_FP8_BLOCK = [128, 128]


class CheckpointFormatError(ValueError):
    """A checkpoint's quantization format is unknown to petals, or its tensors do not follow it."""


@dataclass(frozen=True)
class CheckpointFormat:
    name: str
    # (one block's tensors by checkpoint name, quantization_config, serving dtype) -> plain tensors
    dequantize: Callable[[dict[str, torch.Tensor], dict[str, Any], torch.dtype], dict[str, torch.Tensor]]
    # what a stored tensor's companions (its scales) are named: its name + each suffix
    companion_suffixes: tuple[str, ...] = ()


def dequantize_fp8(
    tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """FP8 weights ``W`` with a float32 ``W_scale_inv``: per block of ``weight_block_size`` (DeepSeek V3,
    Kimi K2, Qwen3 FP8; edge blocks cropped) or one per tensor (``weight_block_size`` null).

    Static activation scales are dropped: the dequantized weights compute in ``dtype``. Without a
    ``weight_block_size`` key the blocks are 128x128, as in transformers' ``FineGrainedFP8Config``.
    Other FP8 layouts under ``quant_method: fp8`` (AutoFP8's ``weight_scale``/``input_scale``) are
    refused: a float8 weight without a ``weight_scale_inv`` is never read as if unscaled.
    """
    block_size = quantization_config.get("weight_block_size", DEFAULT_FP8_BLOCK)
    plain = {
        name: tensor
        for name, tensor in tensors.items()
        if not name.endswith(("weight_scale_inv", "activation_scale"))
    }
    for name, scale_inv in tensors.items():
        if name.endswith("weight_scale_inv"):
            weight_name = name.removesuffix("_scale_inv")
            if weight_name not in tensors:
                raise CheckpointFormatError(f"{name} has no weight {weight_name} to scale")
            plain[weight_name] = _dequantize_fp8_weight(
                weight_name, tensors[weight_name], scale_inv, block_size, dtype
            )
    unscaled = sorted(name for name, tensor in plain.items() if tensor.dtype in FP8_DTYPES)
    if unscaled:
        autofp8 = any(name + "_scale" in tensors for name in unscaled)
        raise CheckpointFormatError(
            f"fp8 tensors without a weight_scale_inv: {', '.join(unscaled)}"
            + (
                " (weight_scale and input_scale are AutoFP8's layout, which petals does not read yet)"
                if autofp8
                else ""
            )
        )
    return _to_dtype(plain, dtype)


FP8_ROWS_PER_CHUNK = 128  # rows dequantized at a time in float32 (per-tensor scales; blocks: a block's rows)


def _dequantize_fp8_weight(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``weight * scale_inv`` (each block's scale over its rows and columns) in float32, rounded once to
    ``dtype``, a band of rows at a time: loading needs the fp8 weight, the result and one band's
    float32 temporaries, not float32 copies of the whole weight and of its expanded scales."""
    # FP4-packed experts (int8) and power-of-two scales (ue8m0, uint8) are other layouts: refused, not misread
    if weight.dtype not in FP8_DTYPES or scale_inv.dtype not in (torch.float32, torch.bfloat16):
        raise CheckpointFormatError(
            f"{name}: a {weight.dtype} weight with {scale_inv.dtype} scales is not the fp8 layout petals "
            "reads (float8 weights, float32 scales)"
        )
    scale_inv = scale_inv.to(torch.float32)
    rows, cols = weight.shape[-2:]
    if block_size is None or scale_inv.numel() == 1:
        band, scale_of_band = FP8_ROWS_PER_CHUNK, lambda _: scale_inv.reshape(())
    else:
        grid = (-(-rows // block_size[0]), -(-cols // block_size[1]))
        if tuple(scale_inv.shape) != (*weight.shape[:-2], *grid):
            raise CheckpointFormatError(
                f"{name}: weight {tuple(weight.shape)} in blocks of {list(block_size)} needs scales of shape "
                f"{(*weight.shape[:-2], *grid)}, the checkpoint has {tuple(scale_inv.shape)}"
            )
        band = block_size[0]

        def scale_of_band(index: int) -> torch.Tensor:  # [..., 1, cols]: the band's scales along its row
            scales = scale_inv[..., index : index + 1, :]
            return scales.repeat_interleave(block_size[1], dim=-1)[..., :cols]

    dequantized = torch.empty(weight.shape, dtype=dtype)
    for index, start in enumerate(range(0, rows, band)):
        rows_of_band = slice(start, start + band)
        dequantized[..., rows_of_band, :] = (
            weight[..., rows_of_band, :].to(torch.float32) * scale_of_band(index)
        ).to(dtype)
    return dequantized


def dequantize_mxfp4(
    tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """MXFP4 experts as GPT-OSS publishes them: ``P_blocks`` (uint8, two FP4 e2m1 codes a byte, low
    nibble first, 32 codes a group along the input) with ``P_scales`` (uint8 e8m0: the group's power
    of two + 127) for ``P`` in ``gate_up_proj``, ``down_proj``; every other tensor is dense.

    The dequantization is transformers' own (``integrations.mxfp4.convert_moe_packed_tensors``, which
    also transposes to the layout of transformers' experts), one expert at a time and in chunks of
    ``MXFP4_ROWS_PER_CHUNK`` groups so that its temporaries stay small; only the pairing of names,
    the checks and that loop are ours.
    """
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    plain = {name: tensor for name, tensor in tensors.items() if not name.endswith(("_blocks", "_scales"))}
    for name, blocks in tensors.items():
        if not name.endswith("_blocks"):
            continue
        weight_name, scales = (
            name.removesuffix("_blocks"),
            tensors.get(name.removesuffix("_blocks") + "_scales"),
        )
        if scales is None:
            raise CheckpointFormatError(f"{name} has no {weight_name}_scales to scale it")
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.ndim != 4:
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
        weight = torch.empty(experts, groups * 32, rows, dtype=dtype)
        for expert in range(experts):  # one expert's temporaries at a time, not the whole tensor's
            weight[expert] = convert_moe_packed_tensors(
                blocks[expert : expert + 1],
                scales[expert : expert + 1],
                dtype=dtype,
                rows_per_chunk=MXFP4_ROWS_PER_CHUNK,
            )[0]
        plain[weight_name] = weight
    orphans = [
        name
        for name in tensors
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in tensors
    ]
    if orphans:
        raise CheckpointFormatError(f"mxfp4 scales without their blocks: {', '.join(sorted(orphans))}")
    return _to_dtype(plain, dtype)


MXFP4_ROWS_PER_CHUNK = 1 << 16  # groups of 32 weights dequantized at a time


def dequantize_gptq(
    tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """GPTQ linears (AutoGPTQ / GPTQModel's layout): ``qweight`` int32 ``[in * bits / 32, out]`` packed
    along the input (row ``r`` holds inputs ``r * 32 / bits ...``, the first in the lowest bits),
    ``qzeros`` int32 ``[groups, out * bits / 32]`` packed along the output the same way, ``scales``
    ``[groups, out]`` (float16), ``g_idx`` ``[in]`` (each input's group: act-order checkpoints,
    ``desc_act``, permute it) and an optional ``bias``. ``W[o, i] = scales[g, o] * (q[i, o] - z[g, o])``
    with ``g = g_idx[i]``; ``checkpoint_format`` ``"gptq"`` (v1) stores ``z - 1`` (so ``z = (stored + 1)
    mod 2**bits``), ``"gptq_v2"`` stores ``z``. Bits 2, 4 and 8.

    Written by hand from the format's specification: transformers dequantizes GPTQ only through
    gptqmodel's kernels, which petals does not depend on.
    """
    bits, group_size = (
        _int_bits(quantization_config, "gptq", (2, 4, 8)),
        quantization_config.get("group_size", 128),
    )
    checkpoint_format = quantization_config.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise CheckpointFormatError(
            f"gptq checkpoint_format {checkpoint_format!r} is not one petals reads (gptq, gptq_v2)"
        )
    if quantization_config.get("lm_head"):
        raise CheckpointFormatError("gptq with a quantized lm_head is not one petals reads yet")
    zero_offset = 1 if checkpoint_format == "gptq" else 0
    plain = _without_companions(tensors, ("qweight", "qzeros", "scales", "g_idx"))
    for prefix in _packed_linears(tensors):
        qweight, qzeros, scales = _companions(tensors, prefix, ("qweight", "qzeros", "scales"))
        per_word = 32 // bits
        in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
        zeros = (_unpack(qzeros, bits, dim=1)[:, :out_features] + zero_offset) & ((1 << bits) - 1)
        g_idx = tensors.get(prefix + "g_idx")
        if g_idx is None:
            g_idx = torch.arange(in_features) // (in_features if group_size == -1 else group_size)
        g_idx = g_idx.long()
        _check_shapes(prefix, in_features, out_features, zeros, scales, g_idx)
        plain[prefix + "weight"] = _dequantize_by_inputs(
            lambda start, stop, packed=qweight, per=per_word: _unpack(
                packed[start // per : stop // per], bits, 0
            ),
            zeros,
            scales,
            g_idx,
            dtype,
        )
    return _to_dtype(plain, dtype)


AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # where output k of eight sits among a packed int32's nibbles


def dequantize_awq(
    tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """AWQ linears, GEMM version (AutoAWQ's ``WQLinear_GEMM``): ``qweight`` int32 ``[in, out / 8]`` and
    ``qzeros`` int32 ``[in / group_size, out / 8]``, both packed along the output in AWQ's interleaved
    order (outputs 0, 2, 4, 6, 1, 3, 5, 7 of each eight, lowest bits first), ``scales`` float16
    ``[in / group_size, out]``, an optional ``bias``. ``W[o, i] = scales[g, o] * (q[i, o] - z[g, o])``
    with ``g = i // group_size``, no offset on the zeros.

    Written by hand from the format's specification: transformers dequantizes AWQ only through
    autoawq/gptqmodel's kernels, which petals does not depend on. Other versions (GEMV, marlin and the other
    kernel-specific layouts) pack differently and are refused, as is ``zero_point: false``.
    """
    bits = _int_bits(quantization_config, "awq", (4,))
    version = str(quantization_config.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointFormatError(f"awq version {version!r} is not one petals reads (gemm)")
    if not quantization_config.get("zero_point", True):
        raise CheckpointFormatError("awq without zero points (zero_point: false) is not one petals reads")
    group_size = quantization_config.get("group_size", 128)
    plain = _without_companions(tensors, ("qweight", "qzeros", "scales"))
    reverse = torch.tensor(AWQ_REVERSE_ORDER)
    for prefix in _packed_linears(tensors):
        qweight, qzeros, scales = _companions(tensors, prefix, ("qweight", "qzeros", "scales"))

        def unpack(packed: torch.Tensor) -> torch.Tensor:
            values = _unpack(packed, bits, dim=1).reshape(packed.shape[0], -1, 8)
            return values[:, :, reverse].reshape(packed.shape[0], -1)

        in_features, out_features, zeros = qweight.shape[0], qweight.shape[1] * 32 // bits, unpack(qzeros)
        g_idx = torch.arange(in_features) // (in_features if group_size == -1 else group_size)
        _check_shapes(prefix, in_features, out_features, zeros, scales, g_idx)
        plain[prefix + "weight"] = _dequantize_by_inputs(
            lambda start, stop, packed=qweight: unpack(packed[start:stop]), zeros, scales, g_idx, dtype
        )
    return _to_dtype(plain, dtype)


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


def _without_companions(
    tensors: dict[str, torch.Tensor], suffixes: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    linears = set(_packed_linears(tensors))
    return {
        name: tensor
        for name, tensor in tensors.items()
        if not any(name == prefix + suffix for prefix in linears for suffix in suffixes)
    }


def _companions(
    tensors: dict[str, torch.Tensor], prefix: str, suffixes: tuple[str, ...]
) -> list[torch.Tensor]:
    missing = [prefix + suffix for suffix in suffixes if prefix + suffix not in tensors]
    if missing:
        raise CheckpointFormatError(f"{prefix}qweight has no {', '.join(missing)}")
    found = [tensors[prefix + suffix] for suffix in suffixes]
    if found[0].dtype != torch.int32 or found[1].dtype != torch.int32:
        raise CheckpointFormatError(
            f"{prefix}qweight and qzeros must be int32, the checkpoint has {found[0].dtype}"
        )
    return found


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of ``32 / bits`` values (the first in the lowest bits) → int32 values, along ``dim``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts[None, :, None]) & mask  # [rows, per word, cols]
        return values.reshape(-1, packed.shape[1])
    values = (packed.unsqueeze(2) >> shifts[None, None, :]) & mask  # [rows, cols, per word]
    return values.reshape(packed.shape[0], -1)


CHUNK_ELEMENTS = 1 << 18  # weights of a packed linear dequantized at a time (whole runs of 32 inputs)


def _dequantize_by_inputs(
    unpack_inputs: Callable[[int, int], torch.Tensor],
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``W[o, i] = scales[g_idx[i], o] * (q[i, o] - zeros[g_idx[i], o])`` in float32, rounded once to
    ``dtype``; ``unpack_inputs(start, stop)`` gives ``q[start:stop]``. A chunk of inputs at a time, so
    that loading needs the dense weight and small temporaries, not float32 copies of the whole."""
    in_features, out_features = g_idx.shape[0], scales.shape[1]
    weight = torch.empty(out_features, in_features, dtype=dtype)
    scales = scales.to(torch.float32)
    inputs_per_chunk = max(32, CHUNK_ELEMENTS // max(out_features, 1) // 32 * 32)
    for start in range(0, in_features, inputs_per_chunk):
        stop = min(start + inputs_per_chunk, in_features)
        groups = g_idx[start:stop]
        chunk = (unpack_inputs(start, stop) - zeros[groups]).to(torch.float32) * scales[groups]
        weight[:, start:stop] = chunk.T
    return weight


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


def _to_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in tensors.items()
    }


FORMATS: dict[str, CheckpointFormat] = {
    "fp8": CheckpointFormat("fp8", dequantize_fp8, companion_suffixes=("_scale_inv",)),
    "mxfp4": CheckpointFormat("mxfp4", dequantize_mxfp4),
    "gptq": CheckpointFormat("gptq", dequantize_gptq),
    "awq": CheckpointFormat("awq", dequantize_awq),
}


def checkpoint_format(config: PretrainedConfig) -> CheckpointFormat | None:
    """The format a checkpoint's weights are stored in, None for plain floating-point weights."""
    quantization_config = quantization_config_of(config)
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method")
    if method not in FORMATS:
        raise CheckpointFormatError(
            f"the checkpoint is quantized with quant_method {method!r}, which petals cannot read yet "
            f"(it reads: {', '.join(sorted(FORMATS))}); serve an unquantized release of the model"
        )
    return FORMATS[method]


def quantization_config_of(config: PretrainedConfig) -> dict[str, Any] | None:
    quantization_config = getattr(config, "quantization_config", None)
    if quantization_config is None or isinstance(quantization_config, dict):
        return quantization_config
    return quantization_config.to_dict()


def with_companions(config: PretrainedConfig, names: list[str], stored: Collection[str]) -> list[str]:
    """``names`` and the ``stored`` tensors that dequantizing them needs (their scales)."""
    format = checkpoint_format(config)
    suffixes = format.companion_suffixes if format is not None else ()
    return names + [name + suffix for name in names for suffix in suffixes if name + suffix in stored]


def dequantize_tensors(
    config: PretrainedConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Tensors as the checkpoint stores them (a block's, or the client's embeddings and head), with
    their scales → plain ones (``dtype`` None: the config's dtype, else float32). Unquantized
    checkpoints' tensors are returned as they are."""
    format = checkpoint_format(config)
    if format is None:
        return tensors
    return format.dequantize(tensors, quantization_config_of(config), dtype or serving_dtype(config))


def dequantized_from(model_name_or_path: str | os.PathLike, config: PretrainedConfig) -> str | None:
    """What a server's log and ``petals health`` name as the stored format its weights were dequantized
    from: a quantized checkpoint's ``quant_method`` (``"fp8"``), ``"gguf"`` and the file's quant types
    for a GGUF file, whose config carries no ``quantization_config`` (``"gguf Q4_K/Q6_K"``), None for
    plain weights."""
    from petals.gguf_checkpoint import gguf_file, gguf_quant_types

    gguf = gguf_file(model_name_or_path)
    if gguf is not None:
        return " ".join(["gguf", "/".join(gguf_quant_types(gguf))]).strip()
    format = checkpoint_format(config)
    return format.name if format is not None else None


def dequantized_note(
    stored_as: str, dtype: torch.dtype, device: torch.device | str, quant_type: str | None
) -> str:
    """What a server's log says about a quantized checkpoint's weights: dequantized on CPU at load,
    and on an accelerator still dequantized (no format's own kernels are used), unless ``--quant_type``
    quantizes them again with bitsandbytes."""
    note = (
        f"{stored_as} checkpoint dequantized to {str(dtype).removeprefix('torch.')} on cpu as its blocks load"
    )
    if torch.device(device).type == "cpu":
        return note
    again = f", --quant_type {quant_type} quantizes them again" if quant_type not in (None, "none") else ""
    return f"{note}; served dequantized on {device} (no {stored_as} kernels are used{again})"


def serving_dtype(config: PretrainedConfig) -> torch.dtype:
    """What a quantized checkpoint's weights become when no dtype is asked for: the release's own dtype."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype not in FP8_DTYPES:
        return dtype
    return torch.float32
