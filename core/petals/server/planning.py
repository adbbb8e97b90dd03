"""Deciding what a server runs with: device, dtype, quantization, limits, how many blocks fit, throughput.

``resolve_settings`` turns the settings that were asked for (``ServerSettings`` with its open
defaults) into the ones a ``Server`` runs with. Each rule is a function of its own, so it can be
read and tested alone: ``choose_device``, ``choose_dtype``, ``choose_quant_type``,
``default_limits`` and ``plan_num_blocks`` (weights after quantization + exact KV cache + adapters,
against the device's memory).

``plan_blocks`` is that memory plan alone, from a config and a memory size (a ``BlockPlan``): ``petals
serve`` plans its block count with it, ``petals plan`` prints it for a GPU, ``petals simulate --model``
sizes its GPU kinds with it.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib
import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from petals.formats import StoredWeights
from petals.policies.placement import no_span_fits, span_lengths
from petals.server.settings import (
    FULL_KV_LIMITS,
    GROUPED_KV_LIMITS,
    ModelLimits,
    ServerSettings,
    SettingError,
)

if TYPE_CHECKING:
    from petals.kv_cache import CacheSpec

logger = logging.getLogger(__name__)

GiB = 1024**3


def resolve_settings(settings: ServerSettings) -> ServerSettings:
    """Decide every default left open; measures the throughput unless a number was given.

    Raises ``SettingError`` for a setting that cannot work with this model or machine,
    ``ValueError`` when not even one block fits or the checkpoint's quantization format is unknown,
    ``ModuleNotFoundError`` when an optional package
    that the settings need is missing, and what loading the config or the adapters raises.
    """
    from petals.formats import checkpoint_format
    from petals.server.throughput import resolve_throughput

    config = settings.load_config()
    checkpoint_format(config)  # a release in a format petals cannot read stops here, before it announces
    tensor_parallel_devices = tuple(
        parse_device(device, "tensor_parallel_devices") for device in settings.tensor_parallel_devices
    )
    check_shards_apart(tensor_parallel_devices)
    device = choose_device(settings.device, tensor_parallel_devices, torch.cuda.is_available())
    quant_type = choose_quant_type(settings.quant_type, device, tensor_parallel_devices)
    check_packages(quant_type, tensor_parallel_devices, settings.adapters)
    adapter_weights = adapter_weight_files(settings)
    settings = dataclasses.replace(
        settings,
        dht_prefix=config.dht_prefix,
        dtype=choose_dtype(settings.dtype, config, device),
        device=device,
        quant_type=quant_type,
        weights=choose_weights(settings.weights, quant_type, tensor_parallel_devices),
        tensor_parallel_devices=tensor_parallel_devices,
        **choose_limits(settings, config),
    )
    num_blocks = choose_num_blocks(settings, config, adapter_weights)
    throughput = resolve_throughput(settings, config, num_blocks)
    return dataclasses.replace(settings, num_blocks=num_blocks, throughput=throughput)


def parse_device(device: torch.device | str, setting: str = "device") -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise SettingError(setting, str(error)) from error


def check_shards_apart(tensor_parallel_devices: Sequence[torch.device]) -> None:
    """Refuse a GPU named twice: the ``tensor_parallel`` library all-reduces CUDA shards with NCCL, which takes
    one tensor per GPU (``torch.cuda.nccl.is_available`` is False for two on one device), so such a server
    started, announced itself and failed every request with an AssertionError (seen on an H200 by
    ``benchmarks.gpu``). CPU shards may repeat: their all-reduce is plain torch."""
    named: set[torch.device] = set()
    for device in tensor_parallel_devices:
        if device.type != "cuda":
            continue
        gpu = torch.device("cuda", device.index or 0)
        if gpu in named:
            raise SettingError(
                "tensor_parallel_devices",
                f"{gpu} is named twice, but shards on one GPU cannot all-reduce (tensor_parallel does it "
                "with NCCL, one shard per GPU): name distinct GPUs, or serve without --tensor_parallel_devices",
            )
        named.add(gpu)


def choose_device(
    requested: torch.device | str | None,
    tensor_parallel_devices: Sequence[torch.device],
    cuda_available: bool,
) -> torch.device:
    """The device asked for, else the first tensor-parallel device, else cuda if available, else cpu."""
    if requested is not None:
        return parse_device(requested)
    if tensor_parallel_devices:
        return torch.device(tensor_parallel_devices[0])
    return torch.device("cuda" if cuda_available else "cpu")


def choose_dtype(requested: torch.dtype | str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``auto`` is the checkpoint's dtype, except that float32 (or unknown) is served in bfloat16 on GPUs.

    As in Petals: half precision halves the memory and speeds up GPUs, while on CPU bfloat16 matmuls
    are slow, so float32 stays float32 there.
    """
    if isinstance(requested, torch.dtype):
        return requested
    if requested != "auto":
        return getattr(torch, requested)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype == torch.float32:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return dtype


def choose_quant_type(
    requested: str | None, device: torch.device, tensor_parallel_devices: Sequence[torch.device] = ()
) -> str:
    """nf4 on a GPU (4x the blocks per GiB, as Petals), none on CPU and with tensor parallelism.

    bitsandbytes quantizes on GPUs only, and sharding does not combine with quantization yet.
    """
    if requested is not None:
        return requested
    return "nf4" if torch.device(device).type == "cuda" and not tensor_parallel_devices else "none"


def choose_weights(
    requested: str, quant_type: str, tensor_parallel_devices: Sequence[torch.device] = ()
) -> str:
    """A quantized checkpoint's weights stay packed unless ``--quant_type`` quantizes them again or
    ``tensor_parallel`` shards them (both start from dense weights): then they are dequantized at load."""
    if quant_type != "none" or tensor_parallel_devices:
        return "dequantized"
    return requested


def default_limits(config: PretrainedConfig) -> ModelLimits:
    """The per-block limits for this model: larger when its attention groups query heads (GQA, MQA) in
    every layer that attends, as in Petals; the layers that keep a fixed-size state instead (linear
    attention) or reuse another's keys and values have no say, whichever block comes first."""
    from petals.block import cache_spec

    groups = []
    for index in range(config.num_hidden_layers):
        spec = cache_spec(config, index)
        # a hybrid layer's or a sharing layer's attention part; an attention spec is its own
        group_size = getattr(getattr(spec, "attention", spec), "group_size", None)
        if group_size is not None and spec.reads_from is None:
            groups.append(group_size)
    return GROUPED_KV_LIMITS if min(groups, default=2) > 1 else FULL_KV_LIMITS


def choose_limits(settings: ServerSettings, config: PretrainedConfig) -> dict[str, int]:
    """The limits given in ``settings``, the model's defaults for the others."""
    defaults = default_limits(config)
    return {
        limit.name: getattr(settings, limit.name) or getattr(defaults, limit.name)
        for limit in dataclasses.fields(ModelLimits)
    }


def check_packages(
    quant_type: str, tensor_parallel_devices: Sequence[torch.device], adapters: Sequence[str]
) -> None:
    """Fail before joining the swarm (``ModuleNotFoundError``) when a needed optional package is missing."""
    for package, needed in (
        ("bitsandbytes", quant_type != "none"),
        ("tensor_parallel", bool(tensor_parallel_devices)),
        ("peft", bool(adapters)),
    ):
        if needed:
            importlib.import_module(package)


def adapter_weight_files(settings: ServerSettings) -> dict[str, Path]:
    """Each adapter's safetensors weights (downloaded if needed); a missing or pickle-only one raises."""
    from petals.convert import adapter_files

    hub = {"cache_dir": settings.cache_dir, "token": settings.token}
    return {name: adapter_files(name, name, **hub)[1] for name in settings.adapters}


def choose_num_blocks(
    settings: ServerSettings, config: PretrainedConfig, adapter_weights: Mapping[str, os.PathLike]
) -> int:
    """The blocks asked for (checked against the model), else as many as fit (``plan_num_blocks``).
    No span may begin or end between layers that share keys and values (``closed_boundaries``)."""
    from petals.block import closed_boundaries

    total, closed = config.num_hidden_layers, closed_boundaries(config)
    if settings.block_indices is not None:
        check_block_indices(settings.block_indices, total, closed)
        return len(settings.block_indices)
    if settings.num_blocks is not None:
        if settings.num_blocks > total:
            raise SettingError("num_blocks", f"{settings.num_blocks} blocks asked, but the model has {total}")
        if settings.num_blocks not in span_lengths(total, closed):
            raise SettingError("num_blocks", no_span_fits(total, settings.num_blocks, closed))
        return settings.num_blocks
    num_blocks, _ = plan_num_blocks(
        config,
        settings.device,
        settings.dtype,
        settings.quant_type,
        settings.attn_cache_tokens,
        adapter_files=adapter_weights,
        tensor_parallel_devices=settings.tensor_parallel_devices,
        stored=StoredWeights.of(settings.model, config) if settings.weights == "packed" else None,
    )
    return longest_placeable(num_blocks, total, closed)


def check_block_indices(blocks: range, total: int, closed: frozenset[int]) -> None:
    """``SettingError`` if ``--block_indices`` end past the model, or split blocks that share keys and
    values (``petals.kv_cache.check_span``'s message)."""
    from petals.kv_cache import check_span

    if blocks.stop > total:
        raise SettingError(
            "block_indices", f"blocks {blocks.start}:{blocks.stop} asked, but the model has {total}"
        )
    try:
        check_span(closed, blocks.start, blocks.stop)
    except ValueError as error:
        raise SettingError("block_indices", str(error)) from None


def longest_placeable(num_blocks: int, total: int, closed: frozenset[int]) -> int:
    """The most blocks, up to the ``num_blocks`` that fit in memory, that a span can hold without splitting
    blocks that share keys and values (the planned count itself for nearly every model)."""
    longest = longest_span(num_blocks, total, closed)
    if not longest:
        raise SettingError("num_blocks", no_span_fits(total, num_blocks, closed))
    if longest < num_blocks:
        logger.info(
            "Serving %d blocks, not %d: no span of %d can be placed without splitting blocks that share "
            "keys and values",
            longest,
            num_blocks,
            num_blocks,
        )
    return longest


def longest_span(num_blocks: int, total: int, closed: frozenset[int]) -> int:
    """The longest span of at most ``num_blocks`` blocks that begins and ends at open boundaries (0: none)."""
    return max((length for length in span_lengths(total, closed) if length <= num_blocks), default=0)


def device_memory_bytes(device: torch.device | str) -> int:
    """Memory a server may fill on ``device``: the GPU's total memory, or the host's available RAM on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    return psutil.virtual_memory().available


def adapter_bytes_per_block(config: PretrainedConfig, adapter_files: Mapping[str, os.PathLike]) -> int:
    """LoRA weights per block: each adapter's safetensors size spread over the model's blocks."""
    return sum(Path(path).stat().st_size for path in adapter_files.values()) // config.num_hidden_layers


def plan_num_blocks(
    config: PretrainedConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_type: str | None = None,
    attn_cache_tokens: int | None = None,
    *,
    adapter_files: Mapping[str, os.PathLike] = {},
    tensor_parallel_devices: Sequence[torch.device | str] = (),
    memory_bytes: int | None = None,
    stored: StoredWeights | None = None,
) -> tuple[int, str]:
    """How many blocks fit in device memory, and the arithmetic behind it (also logged): ``plan_blocks``
    for this machine, failing when not even one block fits.

    ``quant_type`` and ``attn_cache_tokens`` left ``None`` are what a server would choose. With tensor
    parallelism the devices' memories add up (counted as ``n * min``); ``memory_bytes`` overrides the
    measured total. ``stored``: a quantized checkpoint served packed (its matrices count in their stored
    bytes).
    """
    devices = tuple(torch.device(d) for d in tensor_parallel_devices) or (torch.device(device),)
    if memory_bytes is None:
        memory_bytes = len(devices) * min(device_memory_bytes(d) for d in devices)
    plan = plan_blocks(
        config,
        dtype,
        choose_quant_type(quant_type, devices[0], tensor_parallel_devices),
        attn_cache_tokens or default_limits(config).attn_cache_tokens,
        memory_bytes,
        devices=devices,
        adapter_bytes=adapter_bytes_per_block(config, adapter_files),
        stored=stored,
    )
    logger.info("Memory plan: %s", plan.explanation)
    if plan.num_blocks < 1:
        raise ValueError(
            f"not even one block fits: {plan.explanation}. Use --quant_type nf4, fewer --attn_cache_tokens, "
            "or set --num_blocks explicitly"
        )
    return plan.num_blocks, plan.explanation


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """What a device holds of a model: each block's weights and cache, and how many consecutive blocks fit.

    ``plan_blocks`` builds it from the config alone; ``petals serve`` (``plan_num_blocks``), ``petals plan``
    and ``petals simulate --model`` all read their numbers from it, so what they say agrees by construction.
    """

    weight_bytes: tuple[int, ...]  # each block's weights as held: quantized, packed as stored, or in dtype
    cache_specs: tuple[CacheSpec, ...]  # each block's cache kind and sizes
    dtype: torch.dtype  # of the cache, and of the weights that are neither quantized nor packed
    attn_cache_tokens: int  # the cache each block reserves, in tokens of its own kind
    memory_bytes: int  # of all devices together
    autograd_bytes: int  # reserved once, for backward passes
    adapter_bytes: int = 0  # LoRA weights per block
    devices: tuple[torch.device, ...] = (torch.device("cuda"),)
    weights_kind: str = ""  # how weights are held, as the explanation names it ("nf4, bfloat16")

    @property
    def cache_bytes_per_token(self) -> tuple[int, ...]:
        """Each block's cache bytes per token of one sequence (0 for a block of fixed-size states)."""
        return tuple(spec.bytes_per_token(self.dtype) for spec in self.cache_specs)

    @property
    def cache_bytes(self) -> tuple[int, ...]:
        """Each block's cache for ``attn_cache_tokens`` tokens, as a server reserves it."""
        return tuple(spec.budget_bytes(self.attn_cache_tokens, self.dtype) for spec in self.cache_specs)

    @property
    def num_blocks(self) -> int:
        """The most consecutive blocks whose weights, caches and adapters fit beside the autograd
        reserve, wherever they start (0: not even one)."""
        costs = [
            weight + cache + self.adapter_bytes
            for weight, cache in zip(self.weight_bytes, self.cache_bytes, strict=True)
        ]
        return most_consecutive_blocks(costs, self.memory_bytes - self.autograd_bytes)

    @property
    def servable_blocks(self) -> int:
        """What a server hosts: ``num_blocks``, less where no span that long can be placed without
        splitting blocks that share keys and values (``longest_placeable``); 0 when none fits."""
        return longest_span(self.num_blocks, len(self.weight_bytes), self._closed)

    @property
    def servers_per_copy(self) -> int | None:
        """How many such servers hold every block once (None: not even one block fits)."""
        total, length, closed = len(self.weight_bytes), self.servable_blocks, self._closed
        count, start = 0, 0
        while start < total:
            stop = min(start + length, total)
            while stop > start and stop in closed:
                stop -= 1
            if stop == start:
                return None
            count, start = count + 1, stop
        return count

    @property
    def _closed(self) -> frozenset[int]:
        from petals.kv_cache import closed_boundaries

        return closed_boundaries(self.cache_specs)

    @property
    def explanation(self) -> str:
        """The arithmetic behind ``num_blocks``, in one line (a server logs it)."""
        return (
            f"{self.num_blocks} blocks = the most consecutive of the model's {len(self.weight_bytes)} that fit "
            f"in {_gib(self.memory_bytes)} memory on {', '.join(map(str, self.devices))} - "
            f"{_gib(self.autograd_bytes)} autograd reserve; per block: {_gib_range(self.weight_bytes)} weights "
            f"({self.weights_kind}) + {_gib_range(self.cache_bytes)} KV cache for {self.attn_cache_tokens} "
            f"tokens + {_gib(self.adapter_bytes)} adapters"
        )

    def holding(self, attn_cache_tokens: int) -> BlockPlan:
        """The same weights and memory with a cache of ``attn_cache_tokens`` tokens per block (a server
        started with ``--attn_cache_tokens``)."""
        return dataclasses.replace(self, attn_cache_tokens=attn_cache_tokens)


def plan_blocks(
    config: PretrainedConfig,
    dtype: torch.dtype,
    quant_type: str,
    attn_cache_tokens: int,
    memory_bytes: int,
    *,
    devices: Sequence[torch.device] = (torch.device("cuda"),),
    adapter_bytes: int = 0,
    stored: StoredWeights | None = None,
) -> BlockPlan:
    """The plan for ``memory_bytes`` of ``devices``, from the config alone (built on the meta device).

    Per block: its own weights (dense or experts, by index) after ``quant_type``, else in their stored
    bytes when ``stored`` (a quantized checkpoint served packed), else in ``dtype``; a KV cache of
    ``attn_cache_tokens`` tokens of its own kind (exact key/value heads, so grouped-query and latent
    attention count; a block of linear-attention states keeps as many sequences as its kind keeps for
    that budget); ``adapter_bytes`` of LoRA. Reserved once: 2 GiB per device for autograd, scaled by
    hidden size as in Petals (``2 GiB * devices / 14336 * hidden``).
    """
    from petals.block import cache_spec
    from petals.convert import estimate_block_weight_bytes

    blocks = range(config.num_hidden_layers)
    return BlockPlan(
        weight_bytes=tuple(
            estimate_block_weight_bytes(config, dtype, quant_type, index, stored) for index in blocks
        ),
        cache_specs=tuple(cache_spec(config, index) for index in blocks),
        dtype=dtype,
        attn_cache_tokens=attn_cache_tokens,
        memory_bytes=memory_bytes,
        autograd_bytes=int(2 * GiB * len(devices) / 14336 * config.hidden_size),
        adapter_bytes=adapter_bytes,
        devices=tuple(devices),
        weights_kind=_weights_kind(quant_type, dtype, stored),
    )


def _weights_kind(quant_type: str, dtype: torch.dtype, stored: StoredWeights | None) -> str:
    if quant_type == "none" and stored is not None:
        return f"{stored.name} packed, the rest {str(dtype).removeprefix('torch.')}"
    return f"{quant_type}, {str(dtype).removeprefix('torch.')}"


def most_consecutive_blocks(costs: Sequence[int], budget: int) -> int:
    """The most consecutive blocks whose ``costs`` add up to at most ``budget`` wherever they start: the
    server picks its span only later, from the swarm, so the costliest span of that length must fit."""
    starts = [0, *itertools.accumulate(costs)]

    def too_many(count: int) -> bool:
        return (
            count > 0 and max(starts[i + count] - starts[i] for i in range(len(costs) - count + 1)) > budget
        )

    # a span that fits leaves every shorter one fitting: the first count that does not, less one
    return bisect.bisect_left(range(len(costs) + 1), True, key=too_many) - 1


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.3f} GiB"


def _gib_range(sizes: Sequence[int]) -> str:
    """One size where all blocks take the same, else the smallest to the largest."""
    low, high = min(sizes), max(sizes)
    return _gib(low) if low == high else f"{_gib(low)} to {_gib(high)}"
