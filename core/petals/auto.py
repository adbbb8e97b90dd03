"""``AutoDistributed*`` classes: dispatch a checkpoint to the plugin serving its ``model_type``."""

from __future__ import annotations

import os
from typing import Any

from transformers import PretrainedConfig

from petals.plugins import get_plugin_manager


def read_model_type(model_name_or_path: str | os.PathLike, **kwargs: Any) -> str:
    """The ``model_type`` in a checkpoint's ``config.json`` (local directory or HF cache/hub), or in a
    GGUF file's metadata as transformers reads it."""
    from petals.gguf_checkpoint import gguf_config_dict, gguf_file

    gguf = gguf_file(model_name_or_path)
    if gguf is not None:
        return gguf_config_dict(gguf)["model_type"]
    config_dict, _ = PretrainedConfig.get_config_dict(model_name_or_path, **kwargs)
    if "model_type" not in config_dict:
        raise ValueError(f"{model_name_or_path}: config.json has no model_type")
    return config_dict["model_type"]


_HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only")


class AutoDistributedConfig:
    """``AutoDistributedConfig.from_pretrained(name_or_path, **overrides)`` → the family's config."""

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike, **kwargs: Any) -> PretrainedConfig:
        hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
        family = get_plugin_manager().family(read_model_type(model_name_or_path, **hub_kwargs))
        return family.config_class.from_pretrained(model_name_or_path, **kwargs)
