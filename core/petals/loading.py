"""Load one block's weights from a Hugging Face-layout checkpoint, reading nothing else.

Checkpoints are found in a local directory or in the Hugging Face cache (a hub download when the
hub is reachable); a GGUF file, or a folder holding one, is read by ``petals.gguf_checkpoint``, and
a multimodal wrapper's checkpoint is read as its text model's by ``petals.wrappers``.
A sharded checkpoint (``model.safetensors.index.json``) is read only from the shards holding the
block; tensors are read one by one with ``safetensors``. Pickle checkpoints (``pytorch_model.bin``)
are refused: nothing is ever unpickled.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.constants import HF_HUB_CACHE
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from safetensors import safe_open
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
from petals.checkpoint_formats import dequantize_tensors
from petals.disk_cache import cache_lock, make_room, mark_used

logger = logging.getLogger(__name__)

CONFIG = "config.json"
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_FILES = ("pytorch_model.bin.index.json", "pytorch_model.bin")
# transformers' conversion patterns match whole-model names (".experts.*.w1.weight"): block keys get a parent
_BLOCK_PARENT = "block."


class CheckpointError(FileNotFoundError):
    """A checkpoint is missing, incomplete or in a format we do not load."""


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint's tensors live: tensor name → file (resolved lazily for hub repos)."""

    source: str
    weight_map: dict[str, str]  # tensor name -> file name inside the checkpoint
    hub_kwargs: dict
    max_disk_space: int | None = None  # bytes the hub cache may use (see petals.disk_cache)

    @classmethod
    def open(
        cls,
        model_name_or_path: str | os.PathLike,
        *,
        cache_dir: str | os.PathLike | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        max_disk_space: int | None = None,
    ) -> Checkpoint:
        from petals.gguf_checkpoint import GGUFCheckpoint, gguf_file
        from petals.wrappers import text_part

        gguf = gguf_file(model_name_or_path)
        if gguf is not None:
            return GGUFCheckpoint.open_file(gguf)
        hub_kwargs = {"cache_dir": cache_dir, "revision": revision, "token": token}
        checkpoint = cls(str(model_name_or_path), {}, hub_kwargs, max_disk_space)
        stored = checkpoint._with_weight_map()
        config = checkpoint._fetch(CONFIG)
        return stored if config is None else text_part(stored, json.loads(config.read_text()))

    def _with_weight_map(self) -> Checkpoint:
        """This checkpoint with the weight map of its safetensors files."""
        index = self._fetch(SAFE_INDEX)
        if index is not None:
            return replace(self, weight_map=json.loads(index.read_text())["weight_map"])
        single = self._fetch(SAFE_SINGLE)
        if single is not None:
            with safe_open(single, framework="pt") as file:
                return replace(self, weight_map=dict.fromkeys(file.keys(), SAFE_SINGLE))
        if any(self._fetch(name) is not None for name in PICKLE_FILES):
            raise CheckpointError(
                f"{self.source} has only pickle weights (pytorch_model.bin); petals loads safetensors only, "
                "because unpickling can run arbitrary code. Convert it with save_pretrained(safe_serialization=True)."
            )
        raise CheckpointError(f"{self.source}: found neither {SAFE_INDEX} nor {SAFE_SINGLE}")

    def _fetch(self, filename: str) -> Path | None:
        """The local path of one checkpoint file, or None if the checkpoint has no such file."""
        local = Path(self.source)
        if local.is_dir():
            path = local / filename
            return path if path.is_file() else None
        try:
            if self.max_disk_space is not None:
                return self._download_within_bound(filename)
            path = Path(hf_hub_download(self.source, filename, **self.hub_kwargs))
            mark_used(path)
            return path
        except EntryNotFoundError:
            return None
        except LocalEntryNotFoundError as error:
            if os.environ.get("HF_HUB_OFFLINE") or _cached_repo_exists(self.source, self.hub_kwargs):
                return None  # offline: the file is not in the cache, so treat it as absent
            raise CheckpointError(
                f"cannot find {self.source}/{filename} locally or on the hub: {error}"
            ) from error

    def _download_within_bound(self, filename: str) -> Path:
        """A hub file, downloaded only after ``make_room`` found space for it under ``max_disk_space``."""
        try:
            path = Path(hf_hub_download(self.source, filename, local_files_only=True, **self.hub_kwargs))
        except LocalEntryNotFoundError:
            cache_dir = Path(self.hub_kwargs["cache_dir"] or HF_HUB_CACHE)
            url = hf_hub_url(self.source, filename, revision=self.hub_kwargs["revision"])
            with cache_lock(cache_dir):
                size = get_hf_file_metadata(url, token=self.hub_kwargs["token"]).size or 0
                make_room(size, cache_dir, self.max_disk_space, keep_repo=self.source)
                path = Path(hf_hub_download(self.source, filename, **self.hub_kwargs))
        mark_used(path)
        return path

    def block_keys(self, block_prefix: str, block_index: int) -> tuple[str, list[str]]:
        """The prefix used for this block in this checkpoint and the tensor names under it.

        Published checkpoints differ in how much of the module path they keep (some published
        repos store ``h.N.`` while ``save_pretrained`` writes ``transformer.h.N.``), so every
        suffix of ``block_prefix`` is tried, longest first.
        """
        parts = block_prefix.split(".")
        for start in range(len(parts)):
            prefix = ".".join(parts[start:] + [str(block_index)]) + "."
            keys = [name for name in self.weight_map if name.startswith(prefix)]
            if keys:
                return prefix, keys
        raise CheckpointError(
            f"{self.source} has no tensors for block {block_index} (looked for {block_prefix}.N.)"
        )

    def read(self, keys: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Read the named tensors, opening only the files that hold them, as stored (``dtype`` is for
        formats dequantized as they are read, such as GGUF's)."""
        tensors: dict[str, torch.Tensor] = {}
        for filename in sorted({self.weight_map[key] for key in keys}):
            path = self._fetch(filename)
            if path is None:
                raise CheckpointError(f"{self.source}: shard {filename} listed in {SAFE_INDEX} is missing")
            with safe_open(path, framework="pt") as file:
                for key in keys:
                    if self.weight_map[key] == filename:
                        tensors[key] = file.get_tensor(key)
        return tensors


def _cached_repo_exists(repo_id: str, hub_kwargs: dict) -> bool:
    from huggingface_hub import scan_cache_dir

    try:
        cache = scan_cache_dir(hub_kwargs.get("cache_dir"))
    except Exception:
        return False
    return any(repo.repo_id == repo_id for repo in cache.repos)


def read_block_state_dict(
    checkpoint: Checkpoint, config: PretrainedConfig, block_index: int, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """One block's tensors, named as the block's own module expects.

    A quantized checkpoint's weights (and their scales, read with them) come back dequantized to
    ``dtype`` (see ``petals.checkpoint_formats``); other tensors keep the checkpoint's dtype.
    """
    prefix, keys = checkpoint.block_keys(config.block_prefix, block_index)
    state_dict = {key[len(prefix) :]: tensor for key, tensor in checkpoint.read(keys, dtype).items()}
    state_dict = dequantize_tensors(config, state_dict, dtype)
    return convert_checkpoint_names(config.model_type, state_dict)


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
            fused.setdefault(name, copy.deepcopy(converter_of[pattern])).add_tensor(
                name, key, pattern, state_dict[key]
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
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> torch.nn.Module:
    """Build block ``block_index`` of a model and fill it with that block's tensors only.

    ``dtype`` None keeps the checkpoint's floating-point dtype (a quantized checkpoint's weights are
    dequantized to the config's dtype). The block is in eval mode with gradients off, on CPU.
    """
    if config is None:
        from petals.auto import AutoDistributedConfig

        config = AutoDistributedConfig.from_pretrained(
            model_name_or_path, cache_dir=cache_dir, revision=revision, token=token
        )
    if not 0 <= block_index < config.num_hidden_layers:
        raise IndexError(f"block {block_index} out of range: the model has {config.num_hidden_layers} blocks")
    if checkpoint is None:
        checkpoint = Checkpoint.open(model_name_or_path, cache_dir=cache_dir, revision=revision, token=token)
    state_dict = read_block_state_dict(checkpoint, config, block_index, dtype)
    with torch.device("meta"):
        block = make_block(config, block_index)
    if dtype is not None:
        kept = kept_in_float32(type(block), dtype)
        state_dict = {
            name: tensor.to(torch.float32 if kept and kept.search(name) else dtype)
            if tensor.is_floating_point()
            else tensor
            for name, tensor in state_dict.items()
        }
    block.load_state_dict(state_dict, strict=True, assign=True)
    leftovers = [name for name, tensor in _named_tensors(block) if tensor.is_meta]
    if leftovers:
        raise CheckpointError(f"block {block_index}: tensors not filled from the checkpoint: {leftovers}")
    return block.eval().requires_grad_(False)


def kept_in_float32(block_class: type, dtype: torch.dtype) -> re.Pattern | None:
    """Which of a block's tensors transformers keeps in float32 when its model loads in ``dtype``: the
    ``_keep_in_fp32_modules_strict`` of the model classes defined beside the block's transformers layer
    (MoE routers' ``gate.weight`` and score-correction biases, say) in float16 and bfloat16, and their
    ``_keep_in_fp32_modules`` in float16, matched on the block's tensor names as transformers matches them."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    from transformers import PreTrainedModel

    patterns: set[str] = set()
    for module_name in {
        cls.__module__ for cls in block_class.__mro__ if cls.__module__.startswith("transformers.")
    }:
        for value in vars(sys.modules[module_name]).values():
            if isinstance(value, type) and issubclass(value, PreTrainedModel):
                patterns.update(value._keep_in_fp32_modules_strict or ())
                if dtype == torch.float16:
                    patterns.update(value._keep_in_fp32_modules or ())
    if not patterns:
        return None
    alternation, _, _ = build_glob_alternation(sorted(patterns))
    return alternation


def _named_tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()
