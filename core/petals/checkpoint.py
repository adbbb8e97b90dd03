"""Where a checkpoint's tensors live, and reading them: safetensors files in a local folder or the hub.

``Checkpoint`` maps tensor names to files and reads a chosen set of tensors; a GGUF file
(``petals.formats.gguf``) and a multimodal wrapper's text part (``petals.wrappers``) are checkpoints
too, and ``petals.loading.open_checkpoint`` picks which one a model name is. Tensors are read one by
one with ``safetensors``, each into memory of its own: a served block never maps its checkpoint file,
so a file changed or cut short under a running server changes nothing it serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.constants import HF_HUB_CACHE
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from safetensors import SafetensorError, safe_open

from petals.disk_cache import cache_lock, make_room, mark_used

logger = logging.getLogger(__name__)

CONFIG = "config.json"
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_FILES = ("pytorch_model.bin.index.json", "pytorch_model.bin")


class CheckpointError(FileNotFoundError):
    """A checkpoint is missing, incomplete or in a format we do not load."""


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint's tensors live: tensor name → file (resolved lazily for hub repos)."""

    source: str
    weight_map: dict[str, str]  # tensor name -> file name inside the checkpoint
    hub_kwargs: dict
    max_disk_space: int | None = None  # bytes the hub cache may use (see petals.disk_cache)

    def with_weight_map(self) -> Checkpoint:
        """This checkpoint with the weight map of its safetensors files."""
        index = self.fetch(SAFE_INDEX)
        if index is not None:
            return replace(self, weight_map=_weight_map_of_index(index))
        single = self.fetch(SAFE_SINGLE)
        if single is not None:
            with _opened(single) as file:
                return replace(self, weight_map=dict.fromkeys(file.keys(), SAFE_SINGLE))
        if any(self.fetch(name) is not None for name in PICKLE_FILES):
            raise CheckpointError(
                f"{self.source} has only pickle weights (pytorch_model.bin); petals loads safetensors only, "
                "because unpickling can run arbitrary code. Convert it with save_pretrained(safe_serialization=True)."
            )
        raise CheckpointError(f"{self.source}: found neither {SAFE_INDEX} nor {SAFE_SINGLE}")

    def fetch(self, filename: str) -> Path | None:
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

    def read(
        self, keys: list[str], dtype: torch.dtype | None = None, packed: bool = False
    ) -> dict[str, torch.Tensor]:
        """Read the named tensors, opening only the files that hold them, as stored, each copied out of
        the file's memory map (``dtype`` and ``packed`` are for formats dequantized as they are read,
        such as GGUF's)."""
        tensors: dict[str, torch.Tensor] = {}
        for filename in sorted({self.weight_map[key] for key in keys}):
            path = self.fetch(filename)
            if path is None:
                raise CheckpointError(f"{self.source}: shard {filename} listed in {SAFE_INDEX} is missing")
            verify_hub_checksum(path)
            with _opened(path) as file:
                for key in keys:
                    if self.weight_map[key] == filename:
                        tensors[key] = _private(_tensor(file, path, key))
        return tensors


DAMAGED = "it is damaged or incomplete: download it again (or copy it whole)"
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")
_verified: dict[tuple[str, int, int], None] = {}  # hub blobs whose sha256 matched: (path, size, mtime)


def verify_hub_checksum(path: Path) -> None:
    """A file of the Hugging Face cache whose blob is named by its sha256 (the hub's checksum of every
    LFS file, safetensors shards included) must still hash to that name: a shard changed after its
    download (a tensor transposed in place keeps every shape) is refused instead of served. Each blob is
    hashed once per process; files outside the cache carry no checksum to verify."""
    blob = path.resolve()
    if blob.parent.name != "blobs" or not _SHA256_NAME.fullmatch(blob.name):
        return
    stat = blob.stat()
    key = (str(blob), stat.st_size, stat.st_mtime_ns)
    if key in _verified:
        return
    started, digest = time.perf_counter(), hashlib.sha256()
    with open(blob, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != blob.name:
        raise CheckpointError(
            f"{path}: its sha256 is not the hub's ({blob.name[:12]}...): the file changed after its download; "
            "download it again (huggingface-cli download --force-download)"
        )
    _verified[key] = None
    logger.debug("sha256 of %s verified in %.2f s", path, time.perf_counter() - started)


@contextlib.contextmanager
def _opened(path: Path):
    """``safe_open(path)``, a file safetensors cannot parse ending in one ``CheckpointError`` naming it."""
    try:
        file = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({_first_line(error)}): {DAMAGED}"
        ) from None
    with file:
        yield file


def _tensor(file, path: Path, key: str) -> torch.Tensor:
    """One tensor of an open file; a file shorter than its header says (cut off) names the tensor."""
    try:
        return file.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise CheckpointError(f"{path}: cannot read tensor {key} ({_first_line(error)}): {DAMAGED}") from None


def _weight_map_of_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{index} is not a valid safetensors index ({_first_line(error)}): {DAMAGED}"
        ) from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in weight_map.items()
    ):
        raise CheckpointError(f"{index}: its weight_map is not a mapping of tensor names to files: {DAMAGED}")
    return weight_map


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _private(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in memory of its own: safetensors maps the file, and a mapped file rewritten under a
    server would change its weights (or kill it with SIGBUS, if cut short)."""
    return tensor.clone()


def _cached_repo_exists(repo_id: str, hub_kwargs: dict) -> bool:
    from huggingface_hub import scan_cache_dir

    try:
        cache = scan_cache_dir(hub_kwargs.get("cache_dir"))
    except Exception:
        return False
    return any(repo.repo_id == repo_id for repo in cache.repos)


def stored_names(model_type: str, name: str) -> list[str]:
    """``name`` (a tensor's or a module path), then each name that transformers' plain renamings for
    ``model_type`` turn into it: a renaming ``^backbone\\.`` -> ``model.`` reads ``model.layers`` from a
    checkpoint's ``backbone.layers``."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    names, wanted = [name], name + "."
    for renaming in get_checkpoint_conversion_mapping(model_type) or []:
        if not isinstance(renaming, WeightRenaming) or len(renaming.target_patterns) != 1:
            continue
        target = _literal(renaming.target_patterns[0])
        for source in map(_literal, renaming.source_patterns):
            if source and target and wanted.startswith(target):
                names.append((source + wanted[len(target) :]).removesuffix("."))
    return names


def _literal(pattern: str) -> str | None:
    """A renaming's pattern as the plain text it matches at the start of a name, or None for a pattern
    that is more than plain text."""
    text = pattern.removeprefix("^").replace("\\.", ".")
    return text if re.fullmatch(r"[\w.]+", text) else None
