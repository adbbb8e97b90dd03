"""What the commands need of MODEL (a local folder or a Hugging Face repo id), each failure one line.

``petals serve`` needs the model's ``config.json`` and weights; ``petals generate / chat / api / tune``
need its config, the weights of the embeddings and LM head, and a tokenizer (from MODEL's folder or
``--tokenizer PATH_OR_ID``). A name that is neither an existing folder nor a repo id the hub (or, offline,
its cache) has is a ``ModelNotFoundError``; a folder without tokenizer files a ``MissingTokenizerError``.
Both are rows of ``KNOWN_FAILURES``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# what transformers says when it cannot find a name locally, nor on the hub (or in its cache, offline)
_NOT_FOUND_TEXTS = ("couldn't connect to", "is not a local folder and is not a valid model identifier")
# how the files holding a tokenizer are named (transformers' fast, sentencepiece, BPE, WordPiece, Tekken)
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "spiece", "tekken")


class ModelNotFoundError(OSError):
    """MODEL is neither a local folder nor a model the Hugging Face hub (or its cache) has."""


class MissingTokenizerError(OSError):
    """MODEL's folder holds no tokenizer, and no ``--tokenizer`` was given."""


def is_path_like(name: str) -> bool:
    return name.startswith((".", "/", "~"))


def check_local_path(name: str, what: str = "model") -> None:
    """A name written as a path (``./x``, ``/x``, ``~/x``) must be a directory, or for a model a GGUF file
    (served as it is, ``petals.formats.gguf``); others are repo ids."""
    path = Path(name).expanduser()
    gguf = what == "model" and path.is_file() and path.suffix == ".gguf"
    if is_path_like(name) and not (path.is_dir() or gguf):
        also = ", a .gguf file" if what == "model" else ""
        raise ModelNotFoundError(
            f"{what} {name}: no such directory; give an existing directory{also} or a Hugging Face repo id "
            "(org/name)"
        )


def not_found(name: str, error: BaseException, what: str = "model") -> ModelNotFoundError | None:
    """The one-line error for ``name``, if ``error`` is transformers failing to find it anywhere."""
    text = str(error)
    if not any(part in text for part in _NOT_FOUND_TEXTS) or Path(name).expanduser().is_dir():
        return None
    if _offline():
        where = "the Hugging Face cache (HF_HUB_OFFLINE is set)"
    elif "couldn't connect to" in text:
        where = "the Hugging Face cache, and the hub cannot be reached from here"
    else:
        where = "the Hugging Face hub"
    return ModelNotFoundError(
        f"{what} {name}: neither a local directory nor a model in {where}; give the path of a model's folder "
        "(config.json, weights and tokenizer files, as save_pretrained writes them) or a repo id that exists"
    )


@contextmanager
def finding(name: str, what: str = "model") -> Iterator[None]:
    """Turn transformers' "cannot find ``name``" failures inside the block into ``ModelNotFoundError``."""
    try:
        yield
    except OSError as error:
        missing = not_found(name, error, what)
        if missing is None:
            raise
        raise missing from error


def load_tokenizer(model: str, tokenizer: str | None = None):
    """MODEL's tokenizer, or the one of ``tokenizer`` (a folder or repo id) when given."""
    from transformers import AutoTokenizer

    source = tokenizer or model
    folder = Path(source).expanduser()
    from petals.formats.gguf import gguf_file, load_gguf_tokenizer

    gguf = gguf_file(source)
    if gguf is not None and not (folder.is_dir() and _has_tokenizer_files(folder)):
        return load_gguf_tokenizer(gguf)  # the tokenizer the GGUF file carries in its metadata
    if folder.is_dir() and not _has_tokenizer_files(folder):
        raise missing_tokenizer(source, tokenizer)
    with finding(source, "tokenizer" if tokenizer else "model"):
        try:
            return AutoTokenizer.from_pretrained(source)
        except ValueError as error:  # "Couldn't instantiate the backend tokenizer ..."
            raise missing_tokenizer(source, tokenizer) from error


def _has_tokenizer_files(folder: Path) -> bool:
    return any(file.name.startswith(TOKENIZER_FILE_PREFIXES) for file in folder.iterdir())


def missing_tokenizer(source: str, tokenizer: str | None) -> MissingTokenizerError:
    if tokenizer is not None:
        return MissingTokenizerError(
            f"--tokenizer {tokenizer}: no tokenizer there that transformers can load; give the folder or "
            "repo id of this model's tokenizer"
        )
    return MissingTokenizerError(
        f"{source} has no tokenizer (no tokenizer.json, tokenizer_config.json or other tokenizer files): "
        "pass --tokenizer PATH_OR_ID "
        "(a folder or repo id holding this model's tokenizer, e.g. the repo it was trained from), or save "
        "one into the folder (tokenizer.save_pretrained); from Python, give model.generate token ids and "
        "decode its output yourself"
    )


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
