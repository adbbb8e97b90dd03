"""How a published checkpoint stores its weights, and how a block's tensors are read back as plain ones.

A quantized release names its format in config.json's ``quantization_config.quant_method``.
``FORMATS`` maps each method petals reads to a ``CheckpointFormat``, whose ``dequantize`` turns one
block's stored tensors (weights and their scales, under the checkpoint's names) into floating-point
weights of the serving dtype, on CPU, at load. The block itself is then built and served as for an
unquantized checkpoint (``--quant_type`` quantizes those weights again, if asked). A method not in
the table is refused by name; a new one (MXFP4, GPTQ, ...) is a row here and its tests.
"""

from __future__ import annotations

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
                weight_name, tensors[weight_name], scale_inv, block_size
            )
    unscaled = [name for name, tensor in plain.items() if tensor.dtype in FP8_DTYPES]
    if unscaled:
        raise CheckpointFormatError(f"fp8 tensors without a weight_scale_inv: {', '.join(sorted(unscaled))}")
    return {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in plain.items()
    }


def _dequantize_fp8_weight(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int] | None
) -> torch.Tensor:
    # FP4-packed experts (int8) and power-of-two scales (ue8m0, uint8) are other layouts: refused, not misread
    if weight.dtype not in FP8_DTYPES or scale_inv.dtype not in (torch.float32, torch.bfloat16):
        raise CheckpointFormatError(
            f"{name}: a {weight.dtype} weight with {scale_inv.dtype} scales is not the fp8 layout petals "
            "reads (float8 weights, float32 scales)"
        )
    weight = weight.to(torch.float32)
    scale_inv = scale_inv.to(torch.float32)
    if block_size is None or scale_inv.numel() == 1:
        return weight * scale_inv.reshape(())
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block_size[0]), -(-cols // block_size[1]))
    if tuple(scale_inv.shape) != (*weight.shape[:-2], *grid):
        raise CheckpointFormatError(
            f"{name}: weight {tuple(weight.shape)} in blocks of {list(block_size)} needs scales of shape "
            f"{(*weight.shape[:-2], *grid)}, the checkpoint has {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.repeat_interleave(block_size[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block_size[1], dim=-1)[..., :cols]
    return weight * scale


FORMATS: dict[str, CheckpointFormat] = {
    "fp8": CheckpointFormat("fp8", dequantize_fp8, companion_suffixes=("_scale_inv",)),
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


def serving_dtype(config: PretrainedConfig) -> torch.dtype:
    """What a quantized checkpoint's weights become when no dtype is asked for: the release's own dtype."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype not in FP8_DTYPES:
        return dtype
    return torch.float32
