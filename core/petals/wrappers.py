"""Multimodal wrapper checkpoints served as the text model they wrap.

Many checkpoints ship as a wrapper (an image-text-to-text model) whose ``config.json`` ``model_type`` is
the wrapper's, with the language model's config under ``text_config``. When no plugin registers the
wrapper's type but one registers its text model's type, petals serves the checkpoint as that text
model: ``text_config_dict`` is the text model's config with what the wrapper decides for it
(``CARRIED_SETTINGS``), and ``text_part`` shows the checkpoint's language-model tensors under the
names of the text causal LM, so that loading by ``block_prefix`` (servers) and by local module names
(clients) finds them. Vision towers and projectors get no names there, so they are never read.

Taken from transformers: the wrapper model class (the checkpoint's ``architectures``, else the
image-text-to-text auto mapping); where the wrapper and the text causal LM keep the text decoder (the
auto mapping's base model class for the text config) and the head (``get_output_embeddings``), both
found on meta-device instances; and the renamings of the checkpoint's own layout into the wrapper's
modules (``get_model_conversion_mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from petals.checkpoint import Checkpoint, CheckpointError
from petals.plugins import PluginManager, UnknownModelTypeError, get_plugin_manager

# set on the wrapper, they decide for its text model: the wrapper model ties its own head, and a
# quantizer writes its settings at the top of config.json
CARRIED_SETTINGS = ("tie_word_embeddings", "quantization_config")


class WrappedTypeWithoutPluginError(UnknownModelTypeError):
    """A wrapper checkpoint whose text model's type no installed plugin registers."""


def wrapped_text_type(config_dict: dict[str, Any]) -> str | None:
    """The ``model_type`` of the text model a wrapper config holds (``text_config``), None for others."""
    text_config = config_dict.get("text_config")
    return text_config.get("model_type") if isinstance(text_config, dict) else None


def served_model_type(config_dict: dict[str, Any], manager: PluginManager) -> str:
    """The model type a checkpoint is served as: its own when a plugin registers it (or it wraps
    nothing), else the type of the text model it wraps, if a plugin registers that one."""
    model_type, text_type = config_dict["model_type"], wrapped_text_type(config_dict)
    families = manager.model_families()
    if model_type in families or text_type is None:
        return model_type
    if text_type in families:
        return text_type
    raise WrappedTypeWithoutPluginError(
        f"model type {model_type!r} wraps a {text_type!r} text model, and no installed plugin registers "
        f"{model_type!r} or {text_type!r}: install a plugin that registers {text_type!r} "
        "(`petals plugins` lists what is installed)"
    )


def text_config_dict(config_dict: dict[str, Any], model_type: str) -> dict[str, Any] | None:
    """The config of the ``model_type`` text model that ``config_dict`` wraps, with the wrapper's
    ``CARRIED_SETTINGS``; None when ``config_dict`` is no wrapper of a ``model_type`` model."""
    if config_dict.get("model_type") == model_type or wrapped_text_type(config_dict) != model_type:
        return None
    carried = {key: config_dict[key] for key in CARRIED_SETTINGS if key in config_dict}
    return {**config_dict["text_config"], **carried}


@dataclass(frozen=True)
class TextCheckpoint(Checkpoint):
    """A wrapper checkpoint's text part: ``weight_map`` under the text causal LM's tensor names, each
    read under its stored name from ``stored``."""

    stored: Checkpoint | None = None
    stored_names: dict[str, str] = field(default_factory=dict)  # text model's name -> stored name

    def read(
        self, keys: list[str], dtype: torch.dtype | None = None, packed: bool = False
    ) -> dict[str, torch.Tensor]:
        tensors = self.stored.read([self.stored_names[key] for key in keys], dtype, packed)
        return {key: tensors[self.stored_names[key]] for key in keys}


def text_part(checkpoint: Checkpoint, config_dict: dict[str, Any]) -> Checkpoint:
    """``checkpoint`` itself, or its text part if it is a wrapper served as its text model."""
    if wrapped_text_type(config_dict) is None:
        return checkpoint
    if served_model_type(config_dict, get_plugin_manager()) == config_dict["model_type"]:
        return checkpoint
    stored_names = text_names(config_dict, list(checkpoint.weight_map))
    weight_map = {name: checkpoint.weight_map[stored] for name, stored in stored_names.items()}
    return TextCheckpoint(
        checkpoint.source,
        weight_map,
        checkpoint.hub_kwargs,
        checkpoint.max_disk_space,
        stored=checkpoint,
        stored_names=stored_names,
    )


def text_names(config_dict: dict[str, Any], stored: list[str]) -> dict[str, str]:
    """The text causal LM's name of each stored language-model tensor of a wrapper checkpoint (→ its
    stored name); tensors outside the wrapper's decoder and head are left out."""
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    config = AutoConfig.for_model(**config_dict)
    wrapper = _on_meta(_wrapper_class(config), config)
    text_config = config.get_text_config()
    text = _on_meta(MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)], text_config)
    renamings = [t for t in get_model_conversion_mapping(wrapper) if isinstance(t, WeightRenaming)]
    decoder_class = MODEL_MAPPING[type(text_config)]
    paths = dict(zip(_text_paths(wrapper, decoder_class), _text_paths(text, decoder_class), strict=True))
    names: dict[str, str] = {}
    for name in stored:
        renamed, _ = rename_source_key(name, renamings, [])
        for wrapper_path, text_path in paths.items():
            if wrapper_path is not None and renamed.startswith(wrapper_path + "."):
                names[text_path + renamed[len(wrapper_path) :]] = name
    return names


def _wrapper_class(config) -> type:
    """The wrapper's transformers class: the checkpoint's ``architectures``, else the auto mapping's."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    for name in config.architectures or ():
        if isinstance(getattr(transformers, name, None), type):
            return getattr(transformers, name)
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]


def _on_meta(model_class, config) -> torch.nn.Module:
    from petals.meta_device import NoReferenceOpsOnMeta

    with torch.device("meta"), NoReferenceOpsOnMeta():  # only its modules' names are wanted
        return model_class._from_config(config)


def _text_paths(model: torch.nn.Module, decoder_class: type) -> tuple[str, str | None]:
    """Where ``model`` keeps its one ``decoder_class`` module and its output embeddings (None: no head)."""
    decoders = [path for path, module in model.named_modules() if type(module) is decoder_class]
    if len(decoders) != 1:
        raise CheckpointError(
            f"{type(model).__name__} holds {len(decoders)} {decoder_class.__name__} modules, not one: "
            "petals cannot tell which is its text model"
        )
    path_of = {id(module): path for path, module in model.named_modules()}
    return decoders[0], path_of.get(id(model.get_output_embeddings()))
