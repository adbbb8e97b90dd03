"""Checkpoint formats: how a published checkpoint stores its weights, one module per format.

A quantized release names its format in config.json's ``quantization_config.quant_method`` (``fp8``,
``compressed-tensors``, ``mxfp4``, ``gptq``, ``awq``); a GGUF file is a format of its own. Each format is
a ``WeightFormat``, in its own module, that says whether a checkpoint is its own, reads one block's
stored tensors into ``PackedWeight``s (``petals.formats.packed``) that keep the stored encoding, counts
the bytes a matrix takes stored (for planning from the config alone), and which matrices a release
leaves unquantized. A server keeps the packed weights (``--weights packed``, the default) or
dequantizes them as each block loads (``--weights dequantized``: more memory, no per-forward cost);
both use the format's one dequantizer, so they compute the same weights. A method not in the table is
refused by name; a new format is a module here and its tests.

``--quant_type nf4|int8`` quantizes a block's matrices again (``petals.formats.bnb``), from plain or
dequantized weights.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from petals.formats.base import FP8_DTYPES, WEIGHTS_MODES, CheckpointFormatError, WeightFormat, excluded
from petals.formats.fp8 import COMPRESSED_TENSORS, FP8
from petals.formats.int4 import AWQ, GPTQ
from petals.formats.mxfp4 import MXFP4
from petals.formats.packed import PackedWeight, dequantize_in_place, packed_weights


def _formats() -> dict[str, WeightFormat]:
    return {
        method: fmt for fmt in (FP8, COMPRESSED_TENSORS, MXFP4, GPTQ, AWQ) for method in fmt.quant_methods
    }


def quantization_config_of(config: PretrainedConfig) -> dict[str, Any] | None:
    quantization_config = getattr(config, "quantization_config", None)
    if quantization_config is None or isinstance(quantization_config, dict):
        return quantization_config
    return quantization_config.to_dict()


def checkpoint_format(config: PretrainedConfig) -> WeightFormat | None:
    """The format a safetensors checkpoint's weights are stored in, None for plain floating-point
    weights; an unknown ``quant_method`` or an unread variant of a known one raises."""
    quantization_config = quantization_config_of(config)
    if quantization_config is None:
        return None
    formats = _formats()
    method = quantization_config.get("quant_method")
    if method not in formats:
        raise CheckpointFormatError(
            f"the checkpoint is quantized with quant_method {method!r}, which petals cannot read yet "
            f"(it reads: {', '.join(sorted(formats))}); serve an unquantized release of the model"
        )
    formats[method].check(quantization_config)
    return formats[method]


def with_companions(config: PretrainedConfig, names: list[str], stored: Collection[str]) -> list[str]:
    """``names`` and the ``stored`` tensors that dequantizing them needs (their scales)."""
    format = checkpoint_format(config)
    suffixes = format.companion_suffixes if format is not None else ()
    return names + [name + suffix for name in names for suffix in suffixes if name + suffix in stored]


def pack_tensors(
    config: PretrainedConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor | PackedWeight]:
    """A safetensors checkpoint's tensors as stored → packed weights under dense names (``dtype`` None:
    the release's own dtype); plain checkpoints' tensors come back as they are."""
    format = checkpoint_format(config)
    if format is None:
        return tensors
    return format.pack(tensors, quantization_config_of(config), dtype or serving_dtype(config))


def dequantize_tensors(
    config: PretrainedConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Tensors as the checkpoint stores them, with their scales → plain ones in ``dtype``."""
    return {
        name: value.dequantize() if isinstance(value, PackedWeight) else value
        for name, value in pack_tensors(config, tensors, dtype).items()
    }


def stored_as(model_name_or_path: str | os.PathLike, config: PretrainedConfig) -> str | None:
    """What a server's log and ``petals health`` name as its checkpoint's stored format: a quantized
    checkpoint's format (``"fp8"``, ``"gptq int4"``), ``"gguf"`` and the file's quant types for a GGUF file
    (``"gguf Q4_K/Q6_K"``), None for plain weights."""
    from petals.formats.gguf import gguf_file, gguf_quant_types

    gguf = gguf_file(model_name_or_path)
    if gguf is not None:
        return " ".join(["gguf", "/".join(gguf_quant_types(gguf))]).strip()
    format = checkpoint_format(config)
    return format.describe(quantization_config_of(config)) if format is not None else None


@dataclass(frozen=True)
class StoredWeights:
    """How a checkpoint stores its weight matrices, as far as a planner needs it: read from its config
    (and a GGUF file's header), never from the weights."""

    name: str  # "fp8 (128x128 blocks)", "gguf Q4_K/Q6_K"
    format: WeightFormat | None = None
    quantization_config: dict[str, Any] = field(default_factory=dict)
    gguf_nbytes: dict[str, int] | None = None  # a GGUF file's quantized tensors: Hugging Face name -> bytes

    @classmethod
    def of(cls, model_name_or_path: str | os.PathLike, config: PretrainedConfig) -> StoredWeights | None:
        """How ``model_name_or_path`` stores its weights; None for plain floating-point weights."""
        from petals.formats.gguf import gguf_file, gguf_stored_nbytes

        gguf = gguf_file(model_name_or_path)
        if gguf is not None:
            return cls(stored_as(model_name_or_path, config), gguf_nbytes=gguf_stored_nbytes(gguf))
        format = checkpoint_format(config)
        if format is None:
            return None
        quantization_config = quantization_config_of(config)
        return cls(format.describe(quantization_config), format, quantization_config)

    def matrix_nbytes(self, parameter_name: str, shape: Sequence[int], is_experts: bool) -> int | None:
        """Bytes the weight matrix ``parameter_name`` (its full name in the model) takes stored, None
        when the checkpoint stores it dense."""
        if self.gguf_nbytes is not None:
            return self.gguf_nbytes.get(parameter_name)
        module_path = parameter_name.rpartition(".")[0]
        if not self.format.stores_packed(module_path, is_experts, self.quantization_config):
            return None
        return self.format.matrix_nbytes(shape, self.quantization_config)


def weights_note(
    stored: str, weights: str, dtype: torch.dtype, device: torch.device | str, quant_type: str | None
) -> str:
    """What a server's log says of a quantized checkpoint's weights: kept packed (dequantized per
    forward, or by a kernel), dequantized at load, or quantized again by ``--quant_type``."""
    dtype_name = str(dtype).removeprefix("torch.")
    if quant_type not in (None, "none"):
        return f"{stored} checkpoint dequantized at load, then quantized again to {quant_type} (--quant_type)"
    if weights == "dequantized":
        return (
            f"{stored} checkpoint dequantized to {dtype_name} as its blocks load (--weights dequantized: "
            "more memory, no per-forward dequantization)"
        )
    return (
        f"{stored} checkpoint served packed on {torch.device(device)}: weights stay in their stored bytes, "
        f"dequantized to {dtype_name} per forward (MoE: only the routed experts) where no kernel computes "
        "with them (--weights dequantized trades memory for speed)"
    )


def serving_dtype(config: PretrainedConfig) -> torch.dtype:
    """What a quantized checkpoint's weights become when no dtype is asked for: the release's own dtype."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype not in FP8_DTYPES:
        return dtype
    return torch.float32


__all__ = [
    "FP8_DTYPES",
    "WEIGHTS_MODES",
    "CheckpointFormatError",
    "PackedWeight",
    "StoredWeights",
    "WeightFormat",
    "checkpoint_format",
    "dequantize_in_place",
    "dequantize_tensors",
    "excluded",
    "pack_tensors",
    "packed_weights",
    "quantization_config_of",
    "serving_dtype",
    "stored_as",
    "weights_note",
    "with_companions",
]
