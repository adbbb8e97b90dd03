"""GGUF files (the single-file format of ggml-based runtimes) served as they are published, one block at a time.

``petals serve FILE.gguf`` (or a folder holding one ``.gguf`` file and no ``config.json``) serves the file
itself: each server reads only its blocks' tensors, by name. A quantized matrix stays in its GGUF blocks
(``GgufWeight``: the raw rows, dequantized per forward by ``petals.formats.gguf_quants``) unless the
server dequantizes at load (``--weights dequantized``); a 4-bit one (Q4_0, Q4_1, Q4_K) served in
bfloat16 on CPU is repacked for torch's int4 kernel instead (``GgufInt4Weight``, the same bytes). The
client reads the embeddings, norms and head dense, the same way, and the tokenizer from the file. No
dense copy of the model is written anywhere.

Taken from the libraries:

- ``gguf.GGUFReader`` memory-maps the file (only the pages of the tensors read are touched), its metadata
  arrays read in bulk (``petals.patches.gguf_reader``: a 262k-token vocabulary in 0.5 s, not 24 s);
- transformers (``modeling_gguf_pytorch_utils``): the config from the metadata (``PretrainedConfig``
  with ``gguf_file``), the GGUF-name -> Hugging Face-name map (``get_gguf_hf_weights_map``, over the model
  built on the meta device) and the per-architecture fix-ups of tensors (``TENSOR_PROCESSORS``: the
  query/key row permutation of some architectures, gemma's norm offset, MoE expert stacking);
- the tokenizer: ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``.

Written here, because transformers reads a GGUF file only whole: finding the file, reading a chosen
set of tensors (one block's, or the client's) through the processor one tensor at a time and casting
each to the serving dtype at once, and sharing one parsed reader per file in a process (config, weights
and tokenizer each ask for it), until a server has loaded its blocks (``release_readers``). A processor
that only lays out rows is applied to a packed weight's rows: the query/key permutation of some
architectures, the MoE processors' stacking of experts and joining of gate and up into ``gate_up_proj``
(GGUF rows are independent: each is its own blocks). It is run on the row numbers, and what comes back is
the layout (``_row_layout``). A file that cannot be parsed ends in one ``CheckpointError`` naming it.
"""

from __future__ import annotations

import collections
import functools
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petals.checkpoint import DAMAGED, Checkpoint, CheckpointError
from petals.formats.int4pack import Int4Weight
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
    """One ``gguf.GGUFReader`` per file in this process (read-only memory map: safe to share), its metadata
    read in bulk (``petals.patches.gguf_reader``); a file it cannot parse (cut off, or garbage where its
    metadata should be) ends in one ``CheckpointError`` naming it."""
    key = os.path.realpath(path)
    with _READERS_LOCK:
        if key not in _READERS:
            _READERS[key] = _parsed(key)
        return _READERS[key]


# what gguf's reader raises on a damaged file (and petals' reader on a read past its end)
_UNPARSABLE = (ValueError, KeyError, IndexError, OverflowError, MemoryError, struct.error)


def _parsed(path: str):
    from petals.patches import (
        gguf_reader,
    )  # of gguf's own class, not of what shared_readers puts in its place

    try:
        return gguf_reader(path)
    except _UNPARSABLE as error:
        reason = str(error) or type(error).__name__
        raise CheckpointError(f"{path} is not a readable GGUF file ({reason}): {DAMAGED}") from None


def release_readers() -> None:
    """Forget every parsed file: a reader keeps its parsed metadata (a large vocabulary's, 100 MiB and more)
    and the mapped pages of the tensors read for as long as it lives, and a server, once its blocks are
    loaded, reads the file no more (its weights are copies); loading other blocks parses it anew."""
    with _READERS_LOCK:
        _READERS.clear()


def shared_readers():
    """Within: transformers' own GGUF parsing (config, tokenizer) reuses this module's readers."""
    from petals.patches import gguf_parsed_once

    return gguf_parsed_once(reader)


@functools.cache
def _config_dict(key: str) -> dict[str, Any]:
    from transformers import PretrainedConfig

    path = Path(key)
    reader(path)  # parsed here first: a damaged file ends in one line saying so, not in transformers' guess
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
    for hf_name, names in checkpoint.sources.items():
        quantized = [by_name[name] for name in names if is_quantized(by_name[name].tensor_type)]
        if quantized:
            sizes[hf_name] = sum(int(tensor.n_bytes) for tensor in quantized)
    return sizes


def load_gguf_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    path = Path(path)
    reader(path)  # parsed here first, as for the config
    with shared_readers():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@dataclass(frozen=True)
class GGUFCheckpoint(Checkpoint):
    """A GGUF file's tensors under their Hugging Face names. ``sources``: the GGUF tensors each is made of,
    in file order (one, or several that the architecture's processor joins: an MoE's ``gate_up_proj`` of
    ``ffn_gate_exps`` and ``ffn_up_exps``); ``weight_map`` names the first. ``tensor_names``: transformers'
    GGUF name -> Hugging Face name map, which the processor looks names up in."""

    path: Path = field(default=Path())
    architecture: str = ""
    config_dict: dict = field(default_factory=dict)
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tensor_names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open_file(cls, path: str | os.PathLike) -> GGUFCheckpoint:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map, read_field

        path = Path(path)
        file = reader(path)
        architecture = read_field(file, "general.architecture")[0]
        config_dict = gguf_config_dict(path)
        config = AutoConfig.for_model(**config_dict)
        from petals.meta_device import NoReferenceOpsOnMeta

        with torch.device("meta"), NoReferenceOpsOnMeta():  # only its tensors' names are wanted
            model = AutoModelForCausalLM.from_config(config)
        with shared_readers():  # also builds gguf's name map once, not once per module
            to_hf = get_gguf_hf_weights_map(model, _processor(architecture, config_dict))
        sources = _sources(to_hf, [tensor.name for tensor in file.tensors])
        if not sources:
            raise CheckpointError(
                f"{path}: none of its tensors has a name transformers maps for {architecture}"
            )
        weight_map = {hf_name: names[0] for hf_name, names in sources.items()}
        return cls(
            str(path),
            weight_map,
            {},
            path=path,
            architecture=architecture,
            config_dict=config_dict,
            sources=sources,
            tensor_names=to_hf,
        )

    def read(
        self, keys: list[str], dtype: torch.dtype | None = None, packed: bool = False
    ) -> dict[str, torch.Tensor | PackedWeight]:
        """The named tensors, each dequantized to float32 (then ``dtype``) as it is read, one at a time;
        with ``packed``, quantized matrices stay packed (``gguf_weight``) where the architecture's
        processor only lays out their rows (``_row_layout``)."""
        processor = _processor(self.architecture, self.config_dict)
        by_name = {tensor.name: tensor for tensor in reader(self.path).tensors}
        tensors: dict[str, torch.Tensor | PackedWeight] = {}
        for key in keys:
            if key not in self.sources:
                raise CheckpointError(f"{self.path} has no tensor for {key}")
            parts = [by_name[name] for name in self.sources[key]]
            weight = _packed(processor, parts, key, self.tensor_names, dtype) if packed else None
            if weight is not None:
                tensors[key] = weight
                continue
            for name, tensor in _processed(processor, parts, self.tensor_names).items():
                tensors[name] = tensor.to(dtype) if dtype is not None else tensor
        return tensors


def _processor(architecture: str, config_dict: dict):
    """transformers' tensor processor of ``architecture`` (its fix-ups of tensors as GGUF stores them)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config_dict)


def _sources(to_hf: dict[str, str], stored: list[str]) -> dict[str, tuple[str, ...]]:
    """Each Hugging Face name's GGUF tensors, in file order: a stored tensor is found under its name in
    transformers' map, or under its name without ``.weight`` (the key the MoE processors look 3-D experts
    up by: ``blk.0.ffn_gate_exps``), and several can make one tensor (gate and up make ``gate_up_proj``)."""
    sources: dict[str, list[str]] = {}
    for name in stored:
        key = name if name in to_hf else name.removesuffix(".weight")
        if key in to_hf:
            sources.setdefault(to_hf[key], []).append(name)
    return {hf_name: tuple(names) for hf_name, names in sources.items()}


def _processed(processor, parts: list, to_hf: dict[str, str]) -> dict[str, torch.Tensor]:
    """Stored tensors dequantized to float32 and put through the architecture's processor, which may join
    them (MoE experts' gate and up): under their Hugging Face names. A dequantized tensor itself is kept
    where the processor hands its values back unchanged (no copy of a 262k-row embedding)."""
    from petals.formats.gguf_quants import dequantize

    parsed: dict[str, dict] = {"tensors": {}}  # where MoE processors put, and join, stacked experts
    for stored in parts:
        raw = torch.from_numpy(np.asarray(stored.data))
        values = dequantize(raw, int(stored.tensor_type), torch.float32, _shape(stored))
        array = values.numpy()
        result = processor.process(
            weights=array, name=stored.name, tensor_key_mapping=to_hf, parsed_parameters=parsed
        )
        if result.name in to_hf and result.weights is not None:
            same = result.weights is array
            parsed["tensors"][to_hf[result.name]] = (
                values if same else torch.from_numpy(np.array(result.weights))
            )
    return parsed["tensors"]


def _shape(stored) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch's order (GGUF lists the fastest dimension first)."""
    return tuple(int(size) for size in reversed(stored.shape.tolist()))


def _packed(
    processor, parts: list, key: str, to_hf: dict[str, str], dtype: torch.dtype | None
) -> PackedWeight | None:
    """Tensor ``key`` held packed: its parts' GGUF rows (each row its own blocks) laid out as the processor
    lays them out; None where a part is not block-quantized, the parts differ in type or row length, or
    the processor does more than lay out rows."""
    from petals.formats.gguf_quants import is_quantized

    qtypes, widths = {int(part.tensor_type) for part in parts}, {_shape(part)[-1] for part in parts}
    if len(qtypes) != 1 or len(widths) != 1 or not is_quantized(next(iter(qtypes))):
        return None
    layout = _row_layout(processor, parts, key, to_hf)
    if layout is None:
        return None
    (qtype,), (width,), (order, rows_shape) = qtypes, widths, layout
    rows = [torch.from_numpy(np.asarray(part.data)).reshape(-1, part.data.shape[-1]) for part in parts]
    return gguf_weight(
        rows[0] if len(rows) == 1 else torch.cat(rows), qtype, (*rows_shape, width), dtype, order
    )


def _row_layout(
    processor, parts: list, key: str, to_hf: dict[str, str]
) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """How the processor lays out the rows of ``parts`` into tensor ``key``: each of its rows as an index
    into the parts' rows end to end, and its shape but the last dimension. Found by processing the row
    numbers (from 1: a row nobody filled stays 0) of each part in turn, as the file's tensors are
    processed: a query/key permutation reorders them, an MoE processor stacks or joins them. None where the
    processor does more than lay out rows (transposes, arithmetic) or makes any other tensor of them."""
    parsed: dict[str, dict] = {"tensors": {}}
    first = 1
    for stored in parts:
        shape = _shape(stored)
        count = int(np.prod(shape[:-1]))
        numbers = np.arange(first, first + count, dtype=np.float64).reshape(*shape[:-1], 1)
        first += count
        try:
            result = processor.process(
                weights=numbers, name=stored.name, tensor_key_mapping=to_hf, parsed_parameters=parsed
            )
        except (ValueError, IndexError, RuntimeError):  # it needs the rows' width (fused q, k, v)
            return None
        if result.name in to_hf and result.weights is not None:
            parsed["tensors"][to_hf[result.name]] = result.weights
    if set(parsed["tensors"]) != {key}:
        return None
    layout = np.asarray(parsed["tensors"][key])
    order = layout.reshape(-1)
    if layout.shape[-1:] != (1,) or not np.array_equal(np.sort(order), np.arange(1, first)):
        return None
    return torch.from_numpy(order.astype(np.int64) - 1), tuple(layout.shape[:-1])


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
    ``raw``: the stored uint8 rows; ``order``: where the architecture's processor puts them (``_row_layout``)."""
    import petals.formats.int4pack as int4pack
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


class GgufInt4Weight(Int4Weight):
    """A Q4_0, Q4_1 or Q4_K matrix ``[out, in]`` held for torch's CPU int4 kernel
    (``petals.formats.int4pack``): its 4-bit codes repacked into the kernel's layout (``packed``, half a
    byte per weight) and its blocks' scale fields exactly, laid out ``[blocks per row, 1 or groups, out,
    field]`` so that they pair as the kernel pairs a group's scale and zero: ``factors``, float16 (Q4_0's
    ``d``; Q4_1's ``d`` and ``m``; Q4_K's ``d`` and ``dmin``), and Q4_K's ``sub_scales`` (its 6-bit
    sub-block scale and min, a byte each). That is the file's bytes (Q4_K: 1.03x, its 6-bit fields in
    whole bytes, which spares unpacking them per call).

    Per call the kernel's bfloat16 pairs ``[in / 32, out, 2]`` come out of those fields in their order:
    Q4_0's (zero 0) in one conversion; Q4_1's and Q4_K's as float32 pairs (``d`` and ``m``; ``sc * d``
    and ``-(m * dmin)``, one product), each offset turned into the kernel's zero ``offset + 8 * scale`` in
    place, then rounded once (``FourBitType.kernel_scales``' values).

    A bfloat16 input on CPU is computed by the kernel; anything else (float32, a gradient to compute,
    another device, more rows than the kernel is faster for) sees the weight dequantized, exactly as gguf
    dequantizes the blocks (the codes unpack exactly)."""

    group_size = 32  # every 32 inputs share a scale and an offset in these three types

    def __init__(
        self, rows: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> None:
        import petals.formats.int4pack as int4pack
        from petals.formats.gguf_quants import four_bit_type, quant_type

        super().__init__(shape, dtype or torch.float32)
        self.qtype = int(qtype)
        out_features = shape[0]
        four_bit = four_bit_type(qtype)
        blocks = rows.reshape(-1, quant_type(qtype).type_size)
        self.register_buffer("packed", int4pack.pack(four_bit.nibbles(blocks).reshape(shape)))
        parts = [  # each [blocks, 1 or groups] -> [blocks per row, 1 or groups, out]
            part.reshape(out_features, -1, part.shape[-1]).permute(1, 2, 0) for part in four_bit.split(blocks)
        ]
        self.register_buffer("factors", torch.stack(parts[:2], dim=-1))
        self.register_buffer("sub_scales", torch.stack(parts[2:], dim=-1) if parts[2:] else None)

    def _parts(self) -> list[torch.Tensor]:
        """The fields as ``FourBitType.split`` gives them, each a view ``[blocks per row, 1 or groups, out]``."""
        paired = [self.factors] if self.sub_scales is None else [self.factors, self.sub_scales]
        return [pair[..., index] for pair in paired for index in range(pair.shape[-1])]

    def dequantize(self) -> torch.Tensor:
        import petals.formats.int4pack as int4pack
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

    def scales_and_zeros(self) -> torch.Tensor:
        import petals.formats.int4pack as int4pack
        from petals.formats.gguf_quants import four_bit_type

        out_features = self.shape[0]
        if self.factors.shape[-1] == 1:  # Q4_0: d * (q - 8), no zero
            return int4pack.scales_without_zeros(self.factors.view(-1, out_features))
        pairs = self.factors.to(torch.float32)  # Q4_1: scale d, offset m
        if self.sub_scales is not None:  # Q4_K: scale sc * d, offset -(m * dmin)
            pairs[..., 1].neg_()
            pairs = self.sub_scales.to(torch.float32).mul_(pairs)
        pairs[..., 1].add_(pairs[..., 0], alpha=8 + four_bit_type(self.qtype).code_offset)
        return pairs.to(torch.bfloat16).view(-1, out_features, 2)

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
