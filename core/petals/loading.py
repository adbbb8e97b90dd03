"""Load one block's weights from a checkpoint, reading nothing else.

Checkpoints are found in a local directory or in the Hugging Face cache (a hub download when the
hub is reachable, ``petals.checkpoint``); a GGUF file, or a folder holding one, is read by
``petals.formats.gguf``, and a multimodal wrapper's checkpoint is read as its text model's by
``petals.wrappers``. A sharded checkpoint (``model.safetensors.index.json``) is read only from the
shards holding the block. Quantized weights stay packed in their stored encoding
(``petals.formats``) unless the block is loaded with ``weights="dequantized"``. Pickle checkpoints
(``pytorch_model.bin``) are refused: nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys

import torch
from transformers import PretrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    build_glob_alternation,
    dot_natural_key,
    rename_source_key,
)

from petals.block import make_block
from petals.checkpoint import CONFIG, Checkpoint, CheckpointError, stored_names
from petals.formats import pack_tensors
from petals.formats.gguf import GGUFCheckpoint, gguf_file
from petals.formats.packed import PackedWeight, install_weights, set_dtype
from petals.wrappers import text_part

__all__ = ["Checkpoint", "CheckpointError", "load_block", "open_checkpoint", "read_block_state_dict"]
# transformers' conversion patterns match whole-model names (".experts.*.w1.weight"): block keys get a parent
_BLOCK_PARENT = "block."


def open_checkpoint(
    model_name_or_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    max_disk_space: int | None = None,
) -> Checkpoint:
    """The checkpoint a model name or path names: a GGUF file, a wrapper's text part, or safetensors."""
    gguf = gguf_file(model_name_or_path)
    if gguf is not None:
        return GGUFCheckpoint.open_file(gguf)
    hub_kwargs = {"cache_dir": cache_dir, "revision": revision, "token": token}
    checkpoint = Checkpoint(str(model_name_or_path), {}, hub_kwargs, max_disk_space)
    stored = checkpoint.with_weight_map()
    config = checkpoint.fetch(CONFIG)
    return stored if config is None else text_part(stored, json.loads(config.read_text()))


def read_block_state_dict(
    checkpoint: Checkpoint,
    config: PretrainedConfig,
    block_index: int,
    dtype: torch.dtype | None = None,
    weights: str = "dequantized",
) -> dict[str, torch.Tensor | PackedWeight]:
    """One block's tensors, named as the block's own module expects.

    A quantized checkpoint's weights (read with their scales) come back as ``PackedWeight``s holding
    the stored encoding (``weights="packed"``) or dequantized to ``dtype``; other tensors keep the
    checkpoint's dtype.
    """
    prefix, keys = _stored_block_keys(checkpoint, config, block_index)
    stored = checkpoint.read(keys, dtype, packed=weights == "packed")
    state_dict = pack_tensors(config, {key[len(prefix) :]: tensor for key, tensor in stored.items()}, dtype)
    state_dict = convert_checkpoint_names(config.model_type, state_dict)
    if weights == "packed":
        return state_dict
    return {
        name: value.dequantize() if isinstance(value, PackedWeight) else value
        for name, value in state_dict.items()
    }


def _stored_block_keys(
    checkpoint: Checkpoint, config: PretrainedConfig, block_index: int
) -> tuple[str, list[str]]:
    """``checkpoint.block_keys`` under the block prefix, else under a prefix transformers renames to it on
    loading (a family whose checkpoints store their layers under another parent module)."""
    prefixes = stored_names(config.model_type, config.block_prefix)
    try:
        return checkpoint.block_keys(prefixes[0], block_index)
    except CheckpointError:
        for prefix in prefixes[1:]:
            with contextlib.suppress(CheckpointError):
                return checkpoint.block_keys(prefix, block_index)
        raise


def convert_checkpoint_names(model_type: str, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and fuse) one block's checkpoint tensors as transformers does when it loads the whole model.

    Applies transformers' checkpoint conversion mapping for ``model_type`` and its legacy renamings,
    e.g. per-expert checkpoint tensors stacked into transformers 5's fused expert tensors. A family
    whose checkpoints need more registers a mapping with
    ``transformers.conversion_mapping.register_checkpoint_conversion_mapping``.
    """
    transforms = [
        *(get_checkpoint_conversion_mapping(model_type) or []),
        *get_checkpoint_conversion_mapping("legacy"),
    ]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    converted: dict[str, torch.Tensor] = {}
    fused: dict[str, WeightConverter] = {}  # one converter per target tensor, collecting its sources in order
    for key in sorted(state_dict, key=dot_natural_key):  # experts 0, 1, ..., 10 rather than 0, 1, 10
        name, pattern = rename_source_key(_BLOCK_PARENT + key, renamings, converters)
        if pattern is None:
            converted[name] = state_dict[key]
        else:
            # handed over as a loader, as transformers' synchronous loading does: a packed weight is a
            # module, and a callable value would be taken for one
            fused.setdefault(name, copy.deepcopy(converter_of[pattern])).add_tensor(
                name, key, pattern, lambda value=state_dict[key]: value
            )
    for name, converter in fused.items():
        for target, tensor in converter.convert(name).items():
            converted[target] = tensor[0] if isinstance(tensor, list) else tensor
    return {name.removeprefix(_BLOCK_PARENT): tensor for name, tensor in converted.items()}


def load_block(
    model_name_or_path: str | os.PathLike,
    block_index: int,
    dtype: torch.dtype | None = None,
    *,
    config: PretrainedConfig | None = None,
    checkpoint: Checkpoint | None = None,
    weights: str = "packed",
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> torch.nn.Module:
    """Build block ``block_index`` of a model and fill it with that block's tensors only.

    ``dtype`` None keeps the checkpoint's floating-point dtype (a quantized checkpoint's weights
    compute in the config's dtype). A quantized checkpoint's weights stay packed (``weights="packed"``)
    or are dequantized as they load (``"dequantized"``). The block is in eval mode with gradients off,
    on CPU.
    """
    if config is None:
        from petals.auto import AutoDistributedConfig

        config = AutoDistributedConfig.from_pretrained(
            model_name_or_path, cache_dir=cache_dir, revision=revision, token=token
        )
    if not 0 <= block_index < config.num_hidden_layers:
        raise IndexError(f"block {block_index} out of range: the model has {config.num_hidden_layers} blocks")
    if checkpoint is None:
        checkpoint = open_checkpoint(model_name_or_path, cache_dir=cache_dir, revision=revision, token=token)
    state_dict = read_block_state_dict(checkpoint, config, block_index, dtype, weights)
    with torch.device("meta"):
        block = make_block(config, block_index)
    if dtype is not None:
        kept = kept_in_float32(type(block), dtype)
        for name, value in state_dict.items():
            target = torch.float32 if kept and kept.search(name) else dtype
            if isinstance(value, PackedWeight):
                set_dtype(value, target)
            elif value.is_floating_point():
                state_dict[name] = value.to(target)
    _fill_block(block, state_dict, checkpoint, f"{config.block_prefix}.{block_index}.", block_index)
    leftovers = [name for name, tensor in _named_tensors(block) if tensor.is_meta]
    if leftovers:
        raise CheckpointError(f"block {block_index}: tensors not filled from the checkpoint: {leftovers}")
    return block.eval().requires_grad_(False)


def _fill_block(
    block: torch.nn.Module,
    state_dict: dict[str, torch.Tensor | PackedWeight],
    checkpoint: Checkpoint,
    prefix: str,
    block_index: int,
) -> None:
    """Fill ``block`` (on the meta device) with ``state_dict`` after checking it against the block: every
    tensor present, nothing unexpected but known-harmless extras (dropped), every shape and kind as the
    config makes them. A mismatch ends in one ``CheckpointError`` naming the file, block and tensors."""
    expected = dict(block.state_dict(keep_vars=True))
    harmless = harmless_extras(type(block))
    state_dict = {
        name: value
        for name, value in state_dict.items()
        if name in expected or harmless is None or not harmless.search(name)
    }
    problems = [f"missing {name}" for name in expected if name not in state_dict]
    problems += [f"unexpected {name}" for name in state_dict if name not in expected]
    for name, value in state_dict.items():
        if name not in expected:
            continue
        want = expected[name]
        if tuple(value.shape) != tuple(want.shape):
            problems.append(f"{name} is {list(value.shape)}, not {list(want.shape)}")
        elif not isinstance(value, PackedWeight) and value.is_floating_point() != want.is_floating_point():
            problems.append(
                f"{name} is {str(value.dtype).removeprefix('torch.')}, not a {_kind(want)} tensor"
            )
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        where = _file_of(checkpoint, prefix, problems)
        raise CheckpointError(
            f"{where}: block {block_index} does not match the model its config describes ({shown}): "
            "the checkpoint is damaged or belongs to another model; download it again"
        )
    install_weights(block, state_dict)


def _kind(tensor: torch.Tensor) -> str:
    return "floating-point" if tensor.is_floating_point() else "integer"


def _file_of(checkpoint: Checkpoint, prefix: str, problems: list[str]) -> str:
    """The checkpoint file a problem is in: the shard of the first named tensor stored there, else the
    one file holding the block's tensors, else the checkpoint (a GGUF file is its own path)."""
    path = getattr(checkpoint, "path", None)
    if path:
        return str(path)
    for problem in problems:
        name = (
            problem.split(" ")[1]
            if problem.startswith(("missing ", "unexpected "))
            else problem.split(" ")[0]
        )
        stored = checkpoint.weight_map.get(prefix + name)
        if stored is not None:
            return f"{checkpoint.source}/{stored}"
    files = {file for name, file in checkpoint.weight_map.items() if name.startswith(prefix)}
    return f"{checkpoint.source}/{files.pop()}" if len(files) == 1 else checkpoint.source


def harmless_extras(block_class: type) -> re.Pattern | None:
    """Stored tensors transformers ignores when it loads the block's model, and so does a server: rotary
    frequencies and position ids older checkpoints stored per layer (buffers computed, not loaded, today)
    and the model classes' own ``_keys_to_ignore_on_load_unexpected``."""
    patterns = {r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$"}
    for model_class in _model_classes(block_class):
        patterns.update(model_class._keys_to_ignore_on_load_unexpected or ())
    return re.compile("|".join(f"({pattern})" for pattern in sorted(patterns)))


def _model_classes(block_class: type) -> list[type]:
    """transformers' model classes defined beside the block's transformers layer."""
    from transformers import PreTrainedModel

    modules = {cls.__module__ for cls in block_class.__mro__ if cls.__module__.startswith("transformers.")}
    return [
        value
        for module_name in sorted(modules)
        for value in vars(sys.modules[module_name]).values()
        if isinstance(value, type) and issubclass(value, PreTrainedModel)
    ]


def kept_in_float32(block_class: type, dtype: torch.dtype) -> re.Pattern | None:
    """Which of a block's tensors transformers keeps in float32 when its model loads in ``dtype``: the
    ``_keep_in_fp32_modules_strict`` of the model classes defined beside the block's transformers layer
    (MoE routers' ``gate.weight`` and score-correction biases, say) in float16 and bfloat16, and their
    ``_keep_in_fp32_modules`` in float16, matched on the block's tensor names as transformers matches them."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    patterns: set[str] = set()
    for model_class in _model_classes(block_class):
        patterns.update(model_class._keep_in_fp32_modules_strict or ())
        if dtype == torch.float16:
            patterns.update(model_class._keep_in_fp32_modules or ())
    if not patterns:
        return None
    alternation, _, _ = build_glob_alternation(sorted(patterns))
    return alternation


def _named_tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()
