"""GGUF files (the single-file format of ggml-based runtimes) served as they are published, one block at a time.

``petals serve FILE.gguf`` (or a folder holding one ``.gguf`` file and no ``config.json``) serves the file
itself: each server reads only its blocks' tensors, by name. A quantized matrix stays in its GGUF blocks
(``GgufWeight``: the raw rows, dequantized per forward by ``petals.formats.gguf_quants``) unless the
server dequantizes at load (``--weights dequantized``); a 4-bit one (Q4_0, Q4_1, Q4_K) served in
bfloat16 on CPU is repacked for torch's int4 kernel instead (``GgufInt4Weight``, the same bytes). The
client reads the embeddings, norms and head dense, the same way, and the tokenizer from the file. No
dense copy of the model is written anywhere.

Taken from the libraries:

- ``gguf.GGUFReader`` memory-maps the file (only the pages of the tensors read are touched);
- transformers (``modeling_gguf_pytorch_utils``): the config from the metadata (``PretrainedConfig``
  with ``gguf_file``), the GGUF-name -> Hugging Face-name map (``get_gguf_hf_weights_map``, over the model
  built on the meta device) and the per-architecture fix-ups of tensors (``TENSOR_PROCESSORS``: the
  query/key row permutation of some architectures, gemma's norm offset, MoE expert stacking);
- the tokenizer: ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``.

Written here, because transformers reads a GGUF file only whole: finding the file, reading a chosen
set of tensors (one block's, or the client's) through the processor one tensor at a time and casting
each to the serving dtype at once, and sharing one parsed reader per file in a process (parsing a
tokenizer's vocabulary takes seconds, and config, weights and tokenizer each asked for it). A processor
that only reorders rows (the query/key permutation of some architectures) is applied to a packed weight's rows: it is run
on the row numbers, and what comes back is the order (``_row_order``).
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

from petals.checkpoint import Checkpoint, CheckpointError
from petals.formats.packed import PackedWeight

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


def gguf_stored_nbytes(path: str | os.PathLike) -> dict[str, int]:
    """Bytes each block-quantized tensor of a GGUF file takes, under its Hugging Face name (read from the
    header; float tensors are left out: a server holds them in its dtype)."""
    from petals.formats.gguf_quants import is_quantized

    checkpoint = GGUFCheckpoint.open_file(path)
    by_name = {tensor.name: tensor for tensor in reader(path).tensors}
    sizes: dict[str, int] = {}
    for hf_name, name in checkpoint.weight_map.items():
        tensor = by_name[name]
        if is_quantized(tensor.tensor_type):
            sizes[hf_name] = int(tensor.n_bytes)
    return sizes


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

    def read(
        self, keys: list[str], dtype: torch.dtype | None = None, packed: bool = False
    ) -> dict[str, torch.Tensor | PackedWeight]:
        """The named tensors, each dequantized to float32 (then ``dtype``) as it is read, one at a time;
        with ``packed``, quantized matrices stay packed (``gguf_weight``) where the architecture's
        processor only reorders their rows."""
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        from petals.formats.gguf_quants import is_quantized

        processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=self.config_dict)
        to_hf = {name: hf_name for hf_name, name in self.weight_map.items()}
        by_name = {tensor.name: tensor for tensor in reader(self.path).tensors}
        tensors: dict[str, torch.Tensor | PackedWeight] = {}
        for key in keys:
            if key not in self.weight_map:
                raise CheckpointError(f"{self.path} has no tensor for {key}")
            stored = by_name[self.weight_map[key]]
            raw = torch.from_numpy(np.asarray(stored.data))
            if packed and is_quantized(stored.tensor_type):
                order = _row_order(processor, stored, to_hf)
                if order is not None:
                    tensors[key] = gguf_weight(raw, int(stored.tensor_type), _shape(stored), dtype, order)
                    continue
            for name, tensor in _processed(processor, stored, raw, to_hf).items():
                tensors[name] = tensor.to(dtype) if dtype is not None else tensor
        return tensors


def _processed(processor, stored, raw: torch.Tensor, to_hf: dict[str, str]) -> dict[str, torch.Tensor]:
    """A stored tensor dequantized to float32 and put through the architecture's processor: under its
    Hugging Face name, or (MoE processors) the stacked experts it completes. The dequantized tensor
    itself is returned where the processor hands its values back unchanged (no copy of a 262k-row
    embedding)."""
    from petals.formats.gguf_quants import dequantize

    values = dequantize(raw, int(stored.tensor_type), torch.float32, _shape(stored))
    array = values.numpy()
    parsed: dict[str, dict] = {"tensors": {}}  # where MoE processors put stacked experts
    result = processor.process(
        weights=array, name=stored.name, tensor_key_mapping=to_hf, parsed_parameters=parsed
    )
    if result.name in to_hf and result.weights is not None:
        same = result.weights is array
        parsed["tensors"][to_hf[result.name]] = values if same else torch.from_numpy(np.array(result.weights))
    return parsed["tensors"]


def _shape(stored) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch's order (GGUF lists the fastest dimension first)."""
    return tuple(int(size) for size in reversed(stored.shape.tolist()))


def _row_order(processor, stored, to_hf: dict[str, str]) -> torch.Tensor | None:
    """The order ``processor`` gives a tensor's rows, found by processing the row numbers; None when it
    does more than reorder rows (MoE stacking, transposes): that tensor is then read dequantized."""
    shape = _shape(stored)
    rows = int(np.prod(shape[:-1]))
    numbers = np.arange(rows, dtype=np.float64).reshape(*shape[:-1], 1)
    parsed: dict[str, dict] = {"tensors": {}}
    result = processor.process(
        weights=numbers, name=stored.name, tensor_key_mapping=to_hf, parsed_parameters=parsed
    )
    if parsed["tensors"] or result.weights is None or tuple(np.shape(result.weights)) != tuple(numbers.shape):
        return None
    order = torch.from_numpy(np.asarray(result.weights).reshape(-1).astype(np.int64))
    if not torch.equal(torch.sort(order).values, torch.arange(rows)):
        return None
    return order


def gguf_weight(
    raw: torch.Tensor,
    qtype: int,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    order: torch.Tensor | None = None,
) -> PackedWeight:
    """A block-quantized GGUF tensor held packed: a 4-bit matrix (Q4_0, Q4_1, Q4_K) served in bfloat16 on
    CPU, which torch's int4 kernel computes with, as a ``GgufInt4Weight``; anything else as its GGUF
    blocks (``GgufWeight``: in float32, say, every forward dequantizes, and the blocks do that fastest).
    ``raw``: the stored uint8 rows; ``order``: the order the architecture's processor gives the rows."""
    from petals.formats import int4pack
    from petals.formats.gguf_quants import four_bit_type

    rows = raw.reshape(int(np.prod(shape[:-1])), -1)
    if (
        len(shape) == 2
        and dtype == torch.bfloat16
        and four_bit_type(qtype) is not None
        and raw.device.type == "cpu"
        and int4pack.packable(shape[0], shape[1], GgufInt4Weight.group_size)
    ):
        return GgufInt4Weight(rows[order] if order is not None else rows, qtype, shape, dtype)
    return GgufWeight(raw, qtype, shape, dtype, order)


class GgufWeight(PackedWeight):
    """A matrix (or 3-D experts) as GGUF blocks: ``raw`` uint8 ``[rows, bytes per row]`` of quant type
    ``qtype`` (every row its own blocks), in the row order ``order`` (None: as stored)."""

    def __init__(
        self,
        raw: torch.Tensor,
        qtype: int,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
        order: torch.Tensor | None = None,
    ) -> None:
        super().__init__(shape, dtype or torch.float32)
        rows = int(np.prod(shape[:-1]))
        raw = raw.reshape(rows, -1)
        # a private copy (never the file's memory map), in the processor's order (permuted query/key rows)
        raw = raw[order] if order is not None else raw.clone()
        self.qtype = qtype
        self.register_buffer("raw", raw)

    def dequantize(self) -> torch.Tensor:
        from petals.formats.gguf_quants import dequantize

        return dequantize(self.raw, self.qtype, self.dtype, self.shape)

    def expert(self, index: int) -> torch.Tensor:
        from petals.formats.gguf_quants import dequantize

        per_expert = self.raw.shape[0] // self.shape[0]
        rows = self.raw[index * per_expert : (index + 1) * per_expert]
        return dequantize(rows, self.qtype, self.dtype, self.shape[1:])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_type_name(self.qtype)}"


class GgufInt4Weight(PackedWeight):
    """A Q4_0, Q4_1 or Q4_K matrix ``[out, in]`` held for torch's CPU int4 kernel
    (``petals.formats.int4pack``): its 4-bit codes repacked into the kernel's layout (``packed``, half a
    byte per weight) and its blocks' scale fields exactly (``part0``, ``part1``, ...: float16 ``d``, Q4_1's
    ``m``, Q4_K's ``dmin`` and its 6-bit sub-block scales and mins, a byte each), laid out ``[blocks per
    row, groups, out]`` so that the kernel's per-32-input scales and zeros (``[in / 32, out]``) come out
    of them in place per call. That is the file's bytes (Q4_K: 1.03x, its 6-bit fields in whole bytes,
    which spares unpacking them per call).

    A bfloat16 input on CPU is computed by the kernel; anything else (float32, a gradient to compute,
    another device, more rows than the kernel is faster for) sees the weight dequantized, exactly as gguf
    dequantizes the blocks (the codes unpack exactly)."""

    group_size = 32  # every 32 inputs share a scale and an offset in these three types

    def __init__(
        self, rows: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> None:
        from petals.formats import int4pack
        from petals.formats.gguf_quants import four_bit_type, quant_type

        super().__init__(shape, dtype or torch.float32)
        self.qtype = int(qtype)
        out_features, in_features = shape
        four_bit = four_bit_type(qtype)
        blocks = rows.reshape(-1, quant_type(qtype).type_size)
        self.register_buffer("packed", int4pack.pack(four_bit.nibbles(blocks).reshape(shape)))
        parts = four_bit.split(blocks)  # each [blocks, 1 or groups]
        self.parts = len(parts)
        for index, part in enumerate(parts):  # -> [blocks per row, 1 or groups, out]
            laid_out = part.reshape(out_features, -1, part.shape[-1]).permute(1, 2, 0).contiguous()
            self.register_buffer(f"part{index}", laid_out)

    def _parts(self) -> list[torch.Tensor]:
        return [getattr(self, f"part{index}") for index in range(self.parts)]

    def dequantize(self) -> torch.Tensor:
        from petals.formats import int4pack
        from petals.formats.gguf_quants import chunk_values, combine, four_bit_type, in_chunks

        out_features, in_features = self.shape
        four_bit = four_bit_type(self.qtype)

        def fill(packed: torch.Tensor, *parts_and_out: torch.Tensor) -> None:
            *parts, out = parts_and_out
            nibbles = int4pack.unpack(packed, len(packed), in_features, torch.uint8)  # [rows, in]
            by_block = [part.reshape(-1, part.shape[-1]) for part in parts]  # [rows * blocks per row, g]
            blocks = len(by_block[0])
            scales, offsets = four_bit.values(*by_block)
            combine(four_bit.grouped(nibbles, blocks), scales, offsets, out.view(blocks, -1))

        values = torch.empty(self.shape, dtype=self.dtype, device=self.packed.device)
        per_chunk = chunk_values(self.packed.device) // in_features
        tiles = max(1, per_chunk // int4pack.TILE_ROWS) * int4pack.TILE_ROWS
        by_row = [part.permute(2, 0, 1) for part in self._parts()]  # views [out, blocks per row, g]
        in_chunks(values, tiles, fill, self.packed, *by_row)
        return values

    def linear(self, inputs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from petals.formats import int4pack
        from petals.formats.gguf_quants import four_bit_type

        out_features, in_features = self.shape
        rows = inputs.numel() // max(in_features, 1)
        if rows > int4pack.MAX_ROWS or not int4pack.usable(
            inputs, out_features, in_features, self.group_size
        ):
            return super().linear(inputs, bias)
        # [blocks per row, groups, out] -> [in / 32, out], as the kernel takes them (transposed back)
        scales, zeros = (
            part.flatten(0, 1) for part in four_bit_type(self.qtype).kernel_scales(*self._parts())
        )
        outputs = int4pack.matmul(inputs, self.packed, self.group_size, scales.T, zeros.T)
        return outputs if bias is None else outputs + bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_type_name(self.qtype)} as int4 for torch's CPU kernel"


def _type_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


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
