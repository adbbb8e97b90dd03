"""Quantize a served block's weights with bitsandbytes: int8 (LLM.int8()) or nf4.

Every ``nn.Linear`` becomes ``bnb.nn.Linear8bitLt(has_fp16_weights=False, threshold=6.0)`` or
``bnb.nn.Linear4bit`` (nf4, blocksize 64, compressed statistics), as in Petals. Weights that live
outside ``nn.Linear`` (e.g. fused 3-D expert tensors) are quantized by the family through the
``quantize_module`` hook, which receives the same per-linear quantizer. Weights become quantized
when the block moves to its device (``block.to(device)``, done here). bitsandbytes is imported
only when a block is quantized, never by ``import petals``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import torch
from torch import nn

from petals.plugins import get_plugin_manager


class QuantType(enum.StrEnum):
    NONE = "none"
    INT8 = "int8"  # 8-bit weights with fp outliers (LLM.int8()), ~2x smaller than fp16
    NF4 = "nf4"  # 4-bit NormalFloat, ~4x smaller than fp16


def quantize_block(
    block: nn.Module,
    quant_type: QuantType | str,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Replace the block's linear weights by quantized ones in place and move it to ``device``.

    ``compute_dtype`` is the dtype nf4 layers dequantize to (int8 layers compute in the input's dtype).
    Call this while the weights are still on CPU: quantization happens on the move to ``device``.
    """
    quant_type = QuantType(quant_type)
    if quant_type is not QuantType.NONE:
        quantize_linear = _linear_quantizer(quant_type, compute_dtype)
        config = getattr(block, "config", None)
        offer = functools.partial(
            get_plugin_manager().family_hooks(config).quantize_module,
            config=config,
            quantize_linear=quantize_linear,
        )
        _replace_modules(block, offer, quantize_linear)
    return block.to(device)


def _replace_modules(
    module: nn.Module,
    offer: Callable[..., nn.Module | None],  # the family's quantize_module hook, called with module=
    quantize_linear: Callable[[nn.Linear], nn.Module],
) -> None:
    for name, child in module.named_children():
        replacement = quantize_linear(child) if isinstance(child, nn.Linear) else offer(module=child)
        if replacement is not None:
            setattr(module, name, replacement)
        else:
            _replace_modules(child, offer, quantize_linear)


def _linear_quantizer(quant_type: QuantType, compute_dtype: torch.dtype) -> Callable[[nn.Linear], nn.Module]:
    try:
        import bitsandbytes as bnb
    except ImportError as error:
        raise ImportError(
            f"quant_type {quant_type.value!r} needs bitsandbytes: pip install 'petals-core[quantization]'"
        ) from error

    def quantize_linear(linear: nn.Linear) -> nn.Module:
        weight = linear.weight.data
        with torch.device("meta"):  # skip allocating a random initial weight
            if quant_type is QuantType.INT8:
                layer = bnb.nn.Linear8bitLt(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    has_fp16_weights=False,
                    threshold=6.0,
                )
            else:
                layer = bnb.nn.Linear4bit(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    compute_dtype=compute_dtype,
                    compress_statistics=True,
                    quant_type="nf4",
                )
        if quant_type is QuantType.INT8:
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            layer.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=True
            )
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        return layer

    return quantize_linear
