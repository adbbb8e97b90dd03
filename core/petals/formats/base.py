"""What every checkpoint format is (``WeightFormat``) and how it fails (``CheckpointFormatError``).

The format modules (``fp8``, ``mxfp4``, ``int4``, ``gguf``) build on this; ``petals.formats`` picks the
format of a checkpoint.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Sequence
from typing import Any

import torch

from petals.formats.packed import PackedWeight

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHTS_MODES = ("packed", "dequantized")


class CheckpointFormatError(ValueError):
    """A checkpoint's quantization format is unknown to petals, or its tensors do not follow it."""


class WeightFormat:
    """One stored format: what a subclass says of its checkpoints and does with their tensors."""

    name: str = ""
    quant_methods: tuple[str, ...] = ()  # quantization_config.quant_method values that are this format's
    companion_suffixes: tuple[str, ...] = ()  # a stored weight's companions: its name + each suffix

    def check(self, quantization_config: dict[str, Any]) -> None:
        """Raise ``CheckpointFormatError`` for a variant of the format petals does not read."""

    def pack(
        self, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any], dtype: torch.dtype
    ) -> dict[str, torch.Tensor | PackedWeight]:
        """One block's (or the client's) tensors as stored, under the checkpoint's names, with their
        companions → the weights under their dense names (``q_proj.weight``): packed weights
        dequantizing to ``dtype``, plain tensors as they are."""
        raise NotImplementedError

    def matrix_nbytes(self, shape: Sequence[int], quantization_config: dict[str, Any]) -> int:
        """Bytes a weight of ``shape`` (2-D, or 3-D experts) takes stored in this format."""
        raise NotImplementedError

    def stores_packed(self, module_path: str, is_experts: bool, quantization_config: dict[str, Any]) -> bool:
        """Whether a release stores the matrix of ``module_path`` (its full name in the model, such as
        ``model.layers.3.self_attn.q_proj``) in this format rather than dense."""
        return not excluded(module_path, quantization_config.get("modules_to_not_convert") or ())

    def describe(self, quantization_config: dict[str, Any]) -> str:
        return self.name


def excluded(module_path: str, patterns: Collection[str]) -> bool:
    """Whether ``module_path`` is named by one of ``patterns``: a module name or a prefix of its path
    (``lm_head``, ``model.layers.0``), a glob (``model.layers.*.self_attn``) or a regex (``re:.*gate$``,
    compressed-tensors' form)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module_path):
                return True
        elif (
            module_path == pattern
            or module_path.startswith(pattern + ".")
            or module_path.endswith("." + pattern)
            or fnmatch.fnmatchcase(module_path, pattern)
            or fnmatch.fnmatchcase(module_path, pattern + ".*")
        ):
            return True
    return False
