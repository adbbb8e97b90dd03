"""``AutoDistributed*`` classes: dispatch a checkpoint to the plugin serving its ``model_type``."""

from __future__ import annotations

import os
from typing import Any

from transformers import PretrainedConfig

from petals.plugins import get_plugin_manager


def read_config_dict(model_name_or_path: str | os.PathLike, **kwargs: Any) -> dict[str, Any]:
    """A checkpoint's ``config.json`` (local directory or HF cache/hub), or a GGUF file's metadata as
    transformers reads it."""
    from petals.formats.gguf import gguf_config_dict, gguf_file

    gguf = gguf_file(model_name_or_path)
    if gguf is not None:
        return gguf_config_dict(gguf)
    config_dict, _ = PretrainedConfig.get_config_dict(model_name_or_path, **kwargs)
    if "model_type" not in config_dict:
        raise ValueError(f"{model_name_or_path}: config.json has no model_type")
    check_dtypes(config_dict, model_name_or_path)
    return config_dict


class ConfigError(ValueError):
    """A checkpoint's config.json holds a value transformers would fail on with a traceback."""


def check_dtypes(config_dict: dict[str, Any], model_name_or_path: str | os.PathLike) -> None:
    """A ``dtype``/``torch_dtype`` of config.json (or of its ``text_config``) that names no torch dtype
    ends in one line: transformers would fail with ``AttributeError: module 'torch' has no attribute``."""
    import torch

    for scope in (config_dict, config_dict.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = scope.get(key) if isinstance(scope, dict) else None
            if value is None or value == "auto":
                continue
            if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
                raise ConfigError(
                    f"{model_name_or_path}: config.json's {key} {value!r} is not a torch dtype (such as "
                    "float32, bfloat16, float16): fix config.json, or download the checkpoint again"
                )


def read_model_type(model_name_or_path: str | os.PathLike, **kwargs: Any) -> str:
    """The ``model_type`` a checkpoint is served as: its config's, or the text model's that a
    multimodal wrapper holds when a plugin serves that one (``petals.wrappers``)."""
    from petals.wrappers import served_model_type

    return served_model_type(read_config_dict(model_name_or_path, **kwargs), get_plugin_manager())


_HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only")


class AutoDistributedConfig:
    """``AutoDistributedConfig.from_pretrained(name_or_path, **overrides)`` → the family's config."""

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike, **kwargs: Any) -> PretrainedConfig:
        hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
        family = get_plugin_manager().family(read_model_type(model_name_or_path, **hub_kwargs))
        return family.config_class.from_pretrained(model_name_or_path, **kwargs)
