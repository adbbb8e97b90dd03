"""Trained prompts in a file: the prompt tensors in safetensors, and in its metadata what they belong to.

The metadata names the model (as given when training), the tuning mode, ``pre_seq_len`` and the
SHA-256 of the base model's ``config.json`` (canonical JSON, without the keys that say which
transformers version or dtype saved it). A file is refused, in one line, by a model whose config hash
differs: prompts trained for one model mean nothing to another.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT = "petals-prompts"
VERSION = "1"
TENSOR_NAMES = ("prompt_embeddings", "intermediate_prompt_embeddings")
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


class PromptsFileError(ValueError):
    """A prompts file that cannot be used (not one, or made for another model or mode)."""


@dataclass(frozen=True)
class PromptsHeader:
    model: str
    tuning_mode: str
    pre_seq_len: int
    config_sha256: str


def config_sha256(model_name_or_path: str | os.PathLike, **hub_kwargs) -> str:
    """The hash of the base model's ``config.json`` that a prompts file is checked against."""
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(model_name_or_path, **hub_kwargs)
    kept = {key: value for key, value in config.items() if key not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def save_prompts(path: str | os.PathLike, header: PromptsHeader, tensors: dict[str, torch.Tensor]) -> None:
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "model": header.model,
        "tuning_mode": header.tuning_mode,
        "pre_seq_len": str(header.pre_seq_len),
        "config_sha256": header.config_sha256,
    }
    tensors = {
        name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in tensors.items()
    }
    partial = Path(f"{path}.partial")
    save_file(tensors, partial, metadata=metadata)
    os.replace(partial, path)  # an interrupted save never leaves half a file under the real name


def read_header(path: str | os.PathLike) -> PromptsHeader:
    metadata = _open(path, lambda file: file.metadata() or {})
    if metadata.get("format") != FORMAT:
        raise PromptsFileError(f"{path} is not a petals prompts file (no '{FORMAT}' in its metadata)")
    try:
        return PromptsHeader(
            model=metadata["model"],
            tuning_mode=metadata["tuning_mode"],
            pre_seq_len=int(metadata["pre_seq_len"]),
            config_sha256=metadata["config_sha256"],
        )
    except (KeyError, ValueError) as error:
        raise PromptsFileError(f"{path}: incomplete prompts metadata ({error})") from error


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return _open(path, lambda file: {name: file.get_tensor(name) for name in file.keys()})


def check_header(path: str | os.PathLike, header: PromptsHeader, model: str, sha256: str) -> None:
    if header.config_sha256 != sha256:
        raise PromptsFileError(
            f"{path} holds prompts trained for {header.model} (config sha256 {header.config_sha256[:12]}), "
            f"not for {model} (config sha256 {sha256[:12]})"
        )


def _open(path: str | os.PathLike, read):
    try:
        with safe_open(path, framework="pt") as file:
            return read(file)
    except FileNotFoundError as error:
        raise PromptsFileError(f"no prompts file at {path}") from error
    except (SafetensorError, OSError) as error:
        raise PromptsFileError(f"{path} is not a safetensors file: {error}") from error
