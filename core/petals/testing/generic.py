"""The generic plugin: the three-line form of ``plugins/README.md`` made from transformers' own modeling
code of any model type, and a tiny config of that type for the conformance kit.

``generic_family(model_type)`` reads a model of the type built on the meta device: the layer list (its
module path is ``block_prefix``), the class of each decoder layer (one block class per class, named per
``layer_types`` value in ``block_classes`` where a model builds several), the attention module in the
layers (``attn_class``) and the model's rotary embedding (``rotary_class``; none where the model has
none, and then the block hands its layer no ``position_embeddings``). Nothing is written by hand: what
the kit proves of it (``docs/families_sweep.py`` runs it on every causal-LM type) is what the three
lines would serve. Where transformers' layer is not called the rotary way (it takes its cache under
another name, or arguments only its own model computes, such as ALiBi biases), ``UnfitLayerError`` says
so in one line: such a family writes its block's ``forward``.

``tiny_config(model_type)`` shrinks transformers' default config of the type by the names of its
fields (widths, heads, experts, states, vocabulary) and keeps one layer of each kind its default
layer pattern has, so the kit runs in seconds; ``overrides`` fixes what shrinking by name gets wrong.
"""

from __future__ import annotations

import collections
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PretrainedConfig

from petals.block import RotaryBlockMixin
from petals.config import DistributedConfigMixin
from petals.hookspecs import hookimpl
from petals.plugins import PluginError, PluginManager, using_plugin_manager

MIN_LAYERS = 4
VOCAB = 1000
WINDOW = 6


class UnfitLayerError(PluginError, ValueError):
    """transformers' decoder layer of a model type is not called the way the three-line form calls it."""


def _kv_heads(value: int, defaults: dict) -> int:
    """Grouped stays grouped (2 of 4), multi-query stays multi-query, one per query head stays so."""
    heads = defaults.get("num_attention_heads") or defaults.get("n_head")
    return 1 if value == 1 else 4 if value == heads else 2


def _at_most(limit: int) -> Callable[[int, dict], int]:
    return lambda value, defaults: min(value, limit)


# a config field's name (a regular expression, matched in order) -> its tiny value (or how to get it);
# applied to the integer fields of the default config and of the dicts nested in it
SIZES: list[tuple[str, int | Callable[[int, dict], int]]] = [
    (r"^(hidden_size|n_embd|d_model|embed_dim|dim|model_dim|word_embed_proj_dim)$", 64),
    (r"^(num_key_value_heads|num_kv_heads|n_kv_heads|kv_n_heads|num_global_key_value_heads)$", _kv_heads),
    (r"^linear_num_key_heads$", 2),
    (r"(^|_)(num_attention_heads|n_head|n_heads|num_heads|num_value_heads)$", 4),
    (r"^qk_(nope|rope)_head_dim$", 8),
    (r"^v_head_dim$", 12),
    (r"^linear_(key|value)_head_dim$", 8),
    (r"(head_dim|d_head|head_size)$", 16),
    (r"rotary_dim$", 8),
    (r"^kv_lora_rank$", 16),
    (r"^q_lora_rank$", 24),
    (r"(moe|expert|experts)_intermediate_size$|^moe_ffn_hidden_size$", 32),
    (r"(intermediate_size|ffn_dim|n_inner|d_ff|ffn_hidden_size|intermediate_size_mlp)$", 96),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts|n_experts)$", 4),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", _at_most(1)),
    (r"^(num_experts_per_tok|moe_k|top_k|moe_topk|top_k_experts|num_experts_per_token)$", _at_most(2)),
    (r"^(n_group|num_expert_group)$", _at_most(2)),
    (r"^topk_group$", 1),
    (r"^(first_k_dense_replace|moe_layer_start_index)$", _at_most(1)),
    (r"^index_topk$", 4),
    (r"^(vocab_size|vocab_size_per_layer_input)$", VOCAB),
    (r"^hidden_size_per_layer_input$", 16),
    (r"^(sliding_window|attention_chunk_size|sliding_window_size)$", WINDOW),
    (r"(d_state|state_size|state_dim)$", 8),
    (r"(d_conv|conv_kernel|conv_kernel_dim|conv_kernel_size|conv_L_cache)$", 4),
    (r"n_groups$", 2),
    (r"(^|_)expand$", 1),
    (r"time_step_rank$", 8),
    (r"d_ssm$", 64),
    (r"chunk_size$", 4),
]
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def tiny_config(model_type: str, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """transformers' default config of ``model_type``, shrunk for the kit (``overrides`` set last)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    try:
        defaults = config_class().to_dict()
    except Exception:  # defaults its own checks refuse: those that ``overrides`` sets may pass
        defaults = config_class(**(overrides or {})).to_dict()
    tiny = _shrunk(defaults, defaults)
    if defaults.get("qk_rope_head_dim") and defaults.get("head_dim") == defaults["qk_rope_head_dim"]:
        tiny["head_dim"] = tiny["qk_rope_head_dim"]  # a latent attention's head_dim is its rope key's
    layers = next((defaults[key] for key in LAYER_COUNTS if isinstance(defaults.get(key), int)), None)
    if layers:
        tiny = _with_layers(tiny, layers, _kept_layers(tiny, layers))
    tiny = _tokens_in_vocab(tiny)
    return config_class.from_dict({**tiny, **(overrides or {})})


def _shrunk(values: dict, defaults: dict) -> dict:
    shrunk = {}
    for key, value in values.items():
        if isinstance(value, dict):
            shrunk[key] = _shrunk(value, defaults)
            continue
        size = next((size for pattern, size in SIZES if re.search(pattern, str(key))), None)
        if size is not None and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            value = size(value, defaults) if callable(size) else size
        shrunk[key] = value
    return shrunk


def _per_layer_fields(config: dict, layers: int) -> list[str]:
    """The fields holding a value per layer: lists of that length, and patterns (a string a layer)."""
    return [
        key
        for key, value in config.items()
        if (isinstance(value, list) or (isinstance(value, str) and "pattern" in key)) and len(value) == layers
    ]


def _kept_layers(config: dict, layers: int) -> list[int]:
    """The first layer of each kind (the values its per-layer fields give it), in order, and the
    earliest others until there are ``MIN_LAYERS``."""
    fields = _per_layer_fields(config, layers)
    first: dict[tuple, int] = {}
    for index in range(layers):
        first.setdefault(tuple(str(config[key][index]) for key in fields), index)
    kept = set(first.values())
    kept.update([index for index in range(layers) if index not in kept][: max(0, MIN_LAYERS - len(kept))])
    return sorted(kept)


def _with_layers(config: dict, layers: int, kept: list[int]) -> dict:
    config = dict(config)
    for key in _per_layer_fields(config, layers):
        value = [config[key][index] for index in kept]
        config[key] = "".join(value) if isinstance(config[key], str) else value
    new_index = {str(old): new for new, old in enumerate(kept)}
    for key, value in config.items():  # settings by layer index ({"5": {...}}) follow their layers
        if "layer" in key and isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            config[key] = {new_index[str(k)]: v for k, v in value.items() if str(k) in new_index}
    for key in LAYER_COUNTS:
        if isinstance(config.get(key), int) and config[key] == layers:
            config[key] = len(kept)
    return config


def _tokens_in_vocab(config: dict) -> dict:
    """Special token ids past the tiny vocabulary moved into its last ids."""
    moved: dict[int, int] = {}

    def inside(token: Any) -> Any:
        if isinstance(token, list):
            return [inside(item) for item in token]
        if isinstance(token, int) and token >= VOCAB:
            moved.setdefault(token, VOCAB - 1 - len(moved))
            return moved[token]
        return token

    return {key: inside(value) if key.endswith("token_id") else value for key, value in config.items()}


# what RotaryBlockMixin hands a layer (or transformers' layers take and need not be given for text)
CALLED_WITH = {
    "hidden_states", "attention_mask", "position_ids", "cache", "use_cache", "position_embeddings",
    "shared_kv_states", "output_attentions", "cache_position", "encoder_hidden_states",
    "encoder_attention_mask", "output_router_logits", "kwargs",
}  # fmt: skip
# what a block hands its layer's constructor (``ServerBlockMixin``: the layer's type where it takes one)
BUILT_WITH = ("config", "layer_idx", "layer_type")
OTHER_CACHE_NAMES = ("layer_past", "past_key_value", "past_key_values", "state", "mems")


class GenericPlugin:
    """Serves the model types of the config classes it is given (``generic_family``'s)."""

    def __init__(self, *config_classes: type) -> None:
        self.config_classes = config_classes

    @hookimpl
    def register_model_families(self, register) -> None:
        for config_class in self.config_classes:
            register(config_class)


@contextmanager
def serving_generic(config: PretrainedConfig, family: type | None = None) -> Iterator[type]:
    """The generic plugin alone serves ``config``'s model type (installed plugins left out), within;
    ``family``: its config class, if ``generic_family`` made it already."""
    family = family or generic_family(config.model_type, config)
    manager = PluginManager()
    manager.register(GenericPlugin(family), name="generic")
    with using_plugin_manager(manager):
        yield family


def generic_family(model_type: str, config: PretrainedConfig | None = None) -> type:
    """The config class of the three-line plugin for ``model_type``, read from transformers' model of
    ``config`` (``tiny_config(model_type)`` when None) built on the meta device."""
    config = config if config is not None else tiny_config(model_type)
    model = _meta_model(config)
    prefix, layers = _layer_list(model, config)
    classes = _layer_classes(config, layers)
    for layer_class in dict.fromkeys(classes.values()):
        _check_fits(layer_class, model.get_submodule(prefix.rpartition(".")[0]))
    rotary_class = _rotary_class(model, prefix)
    blocks = {layer_class: _block_class(layer_class, rotary_class) for layer_class in classes.values()}
    first = type(layers[0])
    return type(
        f"DistributedGeneric{type(config).__name__}",
        (DistributedConfigMixin, type(config)),
        {
            "__module__": __name__,
            "block_class": blocks[first],
            "block_classes": {kind: blocks[cls] for kind, cls in classes.items() if cls is not first},
            "attn_class": _attention_class(config, layers),
            "block_prefix": prefix,
            "block_output_is_tuple": _returns_tuple(first),
        },
    )


def _block_class(layer_class: type, rotary_class: type | None) -> type:
    namespace = {"__module__": __name__, "rotary_class": rotary_class}
    if _returns_tuple(
        layer_class
    ):  # hidden states and more (attention weights): the block hands on the first
        namespace["forward"] = _first_output
    return type(f"Generic{layer_class.__name__}", (RotaryBlockMixin, layer_class), namespace)


def _first_output(self, hidden_states: torch.Tensor, cache=None, **layer_kwargs) -> torch.Tensor:
    return RotaryBlockMixin.forward(self, hidden_states, cache, **layer_kwargs)[0]


def _meta_model(config: PretrainedConfig) -> torch.nn.Module:
    import copy

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def _layer_list(model: torch.nn.Module, config: PretrainedConfig) -> tuple[str, torch.nn.ModuleList]:
    """The model's list of ``num_hidden_layers`` decoder layers and its module path."""
    count = getattr(config, "num_hidden_layers", None)
    if count is None:
        raise UnfitLayerError(
            f"{type(config).__name__} has no num_hidden_layers: it holds several models' layers"
        )
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and name:
            return name, module
    raise UnfitLayerError(
        f"{type(model).__name__} has no list of its {count} decoder layers (num_hidden_layers): "
        "its layers are not one after another"
    )


def _layer_classes(config: PretrainedConfig, layers: torch.nn.ModuleList) -> dict[str | None, type]:
    """Each layer type's class (key None: one class for all), as transformers picks it by ``layer_types``."""
    classes = [type(layer) for layer in layers]
    if len(set(classes)) == 1:
        return {None: classes[0]}
    layer_types = getattr(config, "layer_types", None) or [None] * len(classes)
    by_type: dict[str | None, set[type]] = collections.defaultdict(set)
    for layer_type, layer_class in zip(layer_types, classes, strict=True):
        by_type[layer_type].add(layer_class)
    if any(len(found) > 1 for found in by_type.values()):
        names = ", ".join(sorted({cls.__name__ for cls in classes}))
        raise UnfitLayerError(f"its layers are of classes {names}, not chosen by their layer_types")
    return {layer_type: found.pop() for layer_type, found in by_type.items()}


def _check_fits(layer_class: type, owner: torch.nn.Module) -> None:
    """UnfitLayerError unless ``layer_class`` is built as a block builds it (config and layer index) and
    called as RotaryBlockMixin calls a layer: hidden states first, its cache as ``cache``, and nothing its
    model computes for it beyond masks and positions."""
    built_with = list(inspect.signature(layer_class.__init__).parameters.values())[1:]
    chosen = _keywords_passed(owner, "__init__")
    needs = [p.name for p in built_with if p.name not in BUILT_WITH and (_required(p) or p.name in chosen)]
    if needs:
        raise UnfitLayerError(f"{layer_class.__name__} is built with {', '.join(needs)} beside its config")
    parameters = list(inspect.signature(layer_class.forward).parameters.values())[1:]
    name = f"{layer_class.__name__}.forward"
    if not parameters or parameters[0].name != "hidden_states":
        raise UnfitLayerError(
            f"{name} takes {parameters[0].name if parameters else 'nothing'}, not hidden_states"
        )
    names = [parameter.name for parameter in parameters]
    if "cache" not in names:
        other = [cache for cache in OTHER_CACHE_NAMES if cache in names]
        raise UnfitLayerError(
            f"{name} takes " + (f"its cache as {other[0]}, not cache" if other else "no cache")
        )
    called = _keywords_passed(owner) | {p.name for p in parameters[1 : 1 + _positional_inputs(owner)]}
    extra = [p.name for p in parameters if p.name not in CALLED_WITH and (p.name in called or _required(p))]
    if extra:
        raise UnfitLayerError(
            f"{type(owner).__name__} hands its layers {', '.join(extra)}, which the three-line block does not"
        )


def _returns_tuple(layer_class: type) -> bool:
    """Whether the layer's forward returns a tuple (its source's returns: annotations are often stale)."""
    try:
        source = inspect.getsource(layer_class.forward)
    except (OSError, TypeError):
        return False
    returned = re.findall(r"^\s*return (.+?)\s*(?:#.*)?$", source, re.MULTILINE)
    return any(value.startswith("(") or "," in value or value == "outputs" for value in returned)


def _required(parameter: inspect.Parameter) -> bool:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return parameter.default is inspect.Parameter.empty and parameter.kind not in variadic


def _keywords_passed(owner: torch.nn.Module, method: str = "forward") -> set[str]:
    """The keyword names ``method`` of the module holding the layers passes anywhere."""
    try:
        source = inspect.getsource(getattr(type(owner), method))
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"\b(\w+)=", source))


def _positional_inputs(owner: torch.nn.Module) -> int:
    """How many inputs beside the hidden states the module holding the layers hands a layer by position
    (a call ``...layer(hidden_states, per_layer_input, ...)`` in its forward's source)."""
    try:
        source = inspect.getsource(type(owner).forward)
    except (OSError, TypeError):
        return 0
    calls = re.findall(r"\w*layer\w*\(\s*hidden_states\s*,((?:\s*\w+(?:\[[^\]]*\])?\s*,)*)", source)
    return max((len([a for a in call.split(",") if a.strip()]) for call in calls), default=0)


def _rotary_class(model: torch.nn.Module, prefix: str) -> type | None:
    """The class of the model's rotary embedding outside its layers (the one nearest the layer list)."""
    found = [
        (name, type(module))
        for name, module in model.named_modules()
        if "Rotary" in type(module).__name__ and not name.startswith(prefix + ".")
    ]
    owner = prefix.rpartition(".")[0]
    found.sort(key=lambda item: (item[0].rpartition(".")[0] != owner, item[0]))
    return found[0][1] if found else None


def _attention_class(config: PretrainedConfig, layers: torch.nn.ModuleList) -> type | None:
    """The class of the shallowest module named ``*Attention`` in the first layer having one, an
    attention layer's first (a linear layer's mixer may be named so too)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(layers)
    attending = [
        kind.endswith(("full_attention", "sliding_attention", "chunked_attention")) for kind in layer_types
    ]
    for _, layer in sorted(zip(attending, layers, strict=True), key=lambda item: not item[0]):
        named = [(name.count("."), type(module)) for name, module in layer.named_modules() if name]
        attention = [item for item in named if item[1].__name__.endswith("Attention")]
        if attention:
            return min(attention, key=lambda item: item[0])[1]
    return None
