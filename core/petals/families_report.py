"""Which of transformers' causal-LM model types this installation serves (``petals plugins --families``).

One row per model type of transformers' causal-LM mapping (and per type a plugin registers beyond it):
the installed plugin serving it, the cache kinds of its layers, or why it is not served. The kinds are
read from the type's default config (transformers' defaults: the published base model's layer mix, as a
rule) through the same ``cache_spec`` a server budgets with, so a plugin's own hook answers for its types;
a plugin may serve kinds its type's default config does not use (LFM2's has attention in every layer,
the plugin also serves its convolution layers), so the column says "default config".
A type transformers does not know, made up by a plugin (the template's ``petals_template``), is not
counted among the served ones; the count line names it apart.

Not served, a row says which of three it is: a multimodal wrapper whose text model a plugin serves
(``petals.wrappers``: served as that text model), a type whose layers core has a cache kind for (a
plugin of the documented three-line form may serve it: ``plugins/README.md``, then the kit), or a type
with a layer kind core cannot cache (named).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from petals.plugins import ModelFamily, PluginManager, get_plugin_manager


@dataclass(frozen=True)
class FamilyRow:
    model_type: str
    plugin: str | None  # the installed plugin serving it, None when none does
    cache_kinds: tuple[str, ...]  # its default config's layer kinds (and what each keeps), in order
    note: str  # served: "" or what it refuses; not served: why, and what would serve it
    made_up: bool = False  # a type only its plugin knows (an example's placeholder), not transformers


def family_rows(manager: PluginManager | None = None) -> list[FamilyRow]:
    """A row per causal-LM model type transformers knows and per model type a plugin registers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as transformers_logging

    manager = manager or get_plugin_manager()
    families = manager.model_families()
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # default configs warn of their own defaults (token ids)
    try:
        return [
            _row(model_type, families)
            for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(families))
        ]
    finally:
        transformers_logging.set_verbosity(verbosity)


def format_rows(rows: list[FamilyRow]) -> str:
    """The rows as an aligned text table, then a count of the served types transformers knows."""
    table = [("model type", "served by", "cache kinds (default config)", "note")]
    table += [(r.model_type, r.plugin or "-", ", ".join(r.cache_kinds) or "?", r.note) for r in rows]
    widths = [max(len(line[column]) for line in table) for column in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line[:3], widths, strict=True)) + "  " + line[3]
        for line in table
    ]
    known = [row for row in rows if not row.made_up]
    served = sum(row.plugin is not None for row in known)
    count = f"{served} of {len(known)} transformers model types served by the installed plugins"
    made_up = [row.model_type for row in rows if row.made_up]
    lines.append(count + (f"; made up by a plugin: {', '.join(made_up)}" if made_up else ""))
    return "\n".join(line.rstrip() for line in lines)


def _row(model_type: str, families: dict[str, ModelFamily]) -> FamilyRow:
    family = families.get(model_type)
    try:
        config = _default_config(model_type, family)
    except Exception as error:  # a config whose defaults its own checks refuse (the refusal is the note)
        plugin = family.plugin if family else None
        return FamilyRow(model_type, plugin, (), f"default config refused: {_one_line(error)}")
    if family is not None:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        made_up = model_type not in CONFIG_MAPPING_NAMES
        note = "made up by its plugin: transformers has no such model" if made_up else ""
        return FamilyRow(model_type, family.plugin, _kinds(config), note, made_up)
    text_config = getattr(config, "text_config", None)
    text_type = getattr(text_config, "model_type", None)
    if text_type is not None and text_type != model_type:
        if text_type in families:
            return FamilyRow(
                model_type,
                None,
                _kinds(text_config),
                f"a wrapper: served as its {text_type} text model by {families[text_type].plugin}",
            )
        return FamilyRow(model_type, None, (), f"a wrapper of {text_type}, which no installed plugin serves")
    return _unserved_row(model_type, config)


def _unserved_row(model_type: str, config: Any) -> FamilyRow:
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    from petals.kv_cache import MANAGERS
    from petals.kv_cache.specs import UnservedSpec, describe_block

    if getattr(config, "is_encoder_decoder", False):
        return FamilyRow(
            model_type, None, (), "the decoder of an encoder-decoder model: a swarm serves decoder-only ones"
        )
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return FamilyRow(
            model_type, None, (), "an encoder family (transformers' causal head is for encoder-decoder use)"
        )
    if not _layers(config):
        return FamilyRow(model_type, None, (), "no plugin; core finds no layer count in its config")
    try:
        specs = [describe_block(config, index) for index in range(_layers(config))]
    except Exception as error:  # core cannot read its layers' kinds or sizes from the config
        return FamilyRow(model_type, None, (), f"no plugin; core cannot size its cache: {_one_line(error)}")
    kinds = _unique(_label(spec) for spec in specs)
    served = {kind.kind.replace("_", " ") for kind in MANAGERS}
    unserved = _unique(spec.describe() for spec in specs if isinstance(spec, UnservedSpec))
    if not unserved:
        note = "no plugin; core caches its layer kinds: try the three-line plugin (plugins/README.md) and the kit"
    elif set(unserved) <= served:
        note = f"no plugin; its {', '.join(unserved)} layers need their sizes from a plugin's cache_spec hook"
    else:
        note = (
            f"no plugin; core has no cache for its {', '.join(k for k in unserved if k not in served)} layers"
        )
    return FamilyRow(model_type, None, kinds, note)


def _default_config(model_type: str, family: ModelFamily | None) -> Any:
    from transformers import CONFIG_MAPPING

    if family is not None:
        return family.config_class()
    return CONFIG_MAPPING[model_type]()


def _kinds(config: Any) -> tuple[str, ...]:
    from petals.block import cache_spec

    return _unique(_label(cache_spec(config, index)) for index in range(_layers(config)))


def _label(spec: Any) -> str:
    """A layer's kind with what it keeps: values per token (float32 elements), or a fixed-size state."""
    import torch

    from petals.kv_cache.specs import UnservedSpec

    if isinstance(spec, UnservedSpec):
        return spec.describe()
    values = spec.bytes_per_token(torch.float32) // 4
    return (
        f"{spec.describe()}: {values:,} values/token" if values else f"{spec.describe()}: a fixed-size state"
    )


def _layers(config: Any) -> int:
    return int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0) or 0)


def _unique(items: Any) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    return line if len(line) <= 160 else line[:159] + "…"
