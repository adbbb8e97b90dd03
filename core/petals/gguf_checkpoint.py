"""GGUF files (the single-file format of ggml-based runtimes) served as they are published, one block at a time.

``petals serve FILE.gguf`` (or a folder holding one ``.gguf`` file and no ``config.json``) serves the file
itself: each server reads only its blocks' tensors, by name, dequantized to the serving dtype as they are
read; the client reads the embeddings, norms and head the same way and the tokenizer from the file. No
dense copy of the model is written anywhere.

Taken from the libraries:

- ``gguf.GGUFReader`` memory-maps the file (only the pages of the tensors read are touched) and
  ``gguf.quants.dequantize`` turns any quant type ``gguf`` knows (Q4_K, Q8_0, F16, ...) into float32;
- transformers (``modeling_gguf_pytorch_utils``): the config from the metadata (``PretrainedConfig``
  with ``gguf_file``), the GGUF-name -> Hugging Face-name map (``get_gguf_hf_weights_map``, over the model
  built on the meta device) and the per-architecture fix-ups of tensors (``TENSOR_PROCESSORS``: the
  query/key row permutation of some architectures, gemma's norm offset, MoE expert stacking);
- the tokenizer: ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``.

Written here, because transformers reads a GGUF file only whole: finding the file, reading a chosen
set of tensors (one block's, or the client's) through the processor one tensor at a time and casting
each to the serving dtype at once, and sharing one parsed reader per file in a process (parsing a
tokenizer's vocabulary takes seconds, and config, weights and tokenizer each asked for it).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petals.loading import Checkpoint, CheckpointError

GGUF_SUFFIX = ".gguf"
_READERS: dict[str, Any] = {}
_READERS_LOCK = threading.Lock()


def gguf_file(model_name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file ``model_name_or_path`` names: the file itself, or the one ``.gguf`` file of a folder
    without ``config.json``; None for anything else (a Hugging Face folder or repo id)."""
    path = Path(model_name_or_path).expanduser()
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*" + GGUF_SUFFIX))
    if len(files) > 1:
        names = ", ".join(file.name for file in files)
        raise CheckpointError(f"{path} holds {len(files)} GGUF files ({names}): name the one to use")
    return files[0] if files else None


def reader(path: str | os.PathLike):
    """One ``gguf.GGUFReader`` per file in this process (read-only memory map: safe to share)."""
    from gguf.gguf_reader import GGUFReader  # the class itself, also where shared_readers stands in for it

    key = os.path.realpath(path)
    with _READERS_LOCK:
        if key not in _READERS:
            _READERS[key] = GGUFReader(key)
        return _READERS[key]


def shared_readers():
    """Within: transformers' own GGUF parsing (config, tokenizer) reuses this module's readers."""
    from petals.patches import gguf_parsed_once

    return gguf_parsed_once(reader)


@functools.cache
def _config_dict(key: str) -> dict[str, Any]:
    from transformers import PretrainedConfig

    path = Path(key)
    with shared_readers():
        config_dict, _ = PretrainedConfig.get_config_dict(str(path.parent), gguf_file=path.name)
    return config_dict


def gguf_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """The config transformers reads from a GGUF file's metadata (``model_type`` included)."""
    return dict(_config_dict(os.path.realpath(path)))


def gguf_quant_types(path: str | os.PathLike) -> list[str]:
    """The types a GGUF file stores its tensors in, the most used first, F32 (norms) left out:
    ``["Q4_K", "Q6_K"]`` for a Q4_K_M build."""
    counts = collections.Counter(tensor.tensor_type.name for tensor in reader(path).tensors)
    return [name for name, _ in counts.most_common() if name != "F32"]


def load_gguf_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    path = Path(path)
    with shared_readers():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@dataclass(frozen=True)
class GGUFCheckpoint(Checkpoint):
    """A GGUF file's tensors under their Hugging Face names: ``weight_map`` maps each to its GGUF name."""

    path: Path = field(default=Path())
    architecture: str = ""
    config_dict: dict = field(default_factory=dict)

    @classmethod
    def open_file(cls, path: str | os.PathLike) -> GGUFCheckpoint:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        path = Path(path)
        file = reader(path)
        architecture = read_field(file, "general.architecture")[0]
        config_dict = gguf_config_dict(path)
        config = AutoConfig.for_model(**config_dict)
        from petals.meta_device import NoReferenceOpsOnMeta

        with torch.device("meta"), NoReferenceOpsOnMeta():  # only its tensors' names are wanted
            model = AutoModelForCausalLM.from_config(config)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config_dict)
        with shared_readers():  # also builds gguf's name map once, not once per module
            to_hf = get_gguf_hf_weights_map(model, processor)
        stored = {tensor.name for tensor in file.tensors}
        weight_map = {hf_name: name for name, hf_name in to_hf.items() if name in stored}
        if not weight_map:
            raise CheckpointError(
                f"{path}: none of its tensors has a name transformers maps for {architecture}"
            )
        return cls(str(path), weight_map, {}, None, path, architecture, config_dict)

    def read(self, keys: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The named tensors, each dequantized to float32 (then ``dtype``) as it is read, one at a time."""
        from gguf.quants import dequantize
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=self.config_dict)
        to_hf = {name: hf_name for hf_name, name in self.weight_map.items()}
        by_name = {tensor.name: tensor for tensor in reader(self.path).tensors}
        tensors: dict[str, torch.Tensor] = {}
        for key in keys:
            if key not in self.weight_map:
                raise CheckpointError(f"{self.path} has no tensor for {key}")
            stored = by_name[self.weight_map[key]]
            parsed: dict[str, dict] = {"tensors": {}}  # where MoE processors put stacked experts
            result = processor.process(
                weights=dequantize(stored.data, stored.tensor_type),
                name=stored.name,
                tensor_key_mapping=to_hf,
                parsed_parameters=parsed,
            )
            if result.name in to_hf and result.weights is not None:
                parsed["tensors"][to_hf[result.name]] = torch.from_numpy(np.array(result.weights))
            for name, tensor in parsed["tensors"].items():
                tensors[name] = tensor.to(dtype) if dtype is not None else tensor
        return tensors


def local_model(model_name_or_path: str | os.PathLike, **kwargs: Any) -> torch.nn.Module:
    """Plain transformers' causal LM of a checkpoint, in eval mode: a GGUF file (or a folder holding one)
    loaded whole and dequantized, as transformers does (the local reference beside a swarm); anything
    else through ``from_pretrained`` as it is."""
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf = gguf_file(model_name_or_path)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(model_name_or_path, **kwargs).eval()
    with shared_readers():
        return AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            **kwargs,
        ).eval()
