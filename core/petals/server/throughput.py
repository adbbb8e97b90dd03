"""How many tokens per second this server can push through its blocks (announced for balancing).

``auto`` measures once and caches the numbers in ``<cache_dir>/throughput_v1.json`` (keyed by the
model's shape, device, dtype, quantization and tensor-parallel devices); ``eval`` measures again; a
float is taken as given. We measure compute only, on a block with random weights converted as the
served ones are (``convert_block``: same quantization, same sharding) and run through the same
``BlockBackend``: a short timed forward of ``FORWARD_TOKENS`` tokens (``forward_rps``) and
single-token steps with a KV cache (``inference_rps``), both per block.
There is no internet speed test: the announced ``throughput`` is
``forward_rps / ((num_blocks + 1) / 2)``, the rate of a request crossing half the server's blocks
on average, as Petals computes it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from petals.block import make_block
from petals.convert import QuantType, convert_block
from petals.server.backend import BlockBackend
from petals.server.settings import THROUGHPUT_CHOICES, ServerSettings, SettingError

logger = logging.getLogger(__name__)

CACHE_FILE = "throughput_v1.json"
FORWARD_TOKENS = 256
FORWARD_STEPS = 3
INFERENCE_STEPS = 16


@dataclass(frozen=True)
class ThroughputInfo:
    throughput: float
    forward_rps: float | None = None
    inference_rps: float | None = None


def resolve_throughput(settings: ServerSettings, config: PretrainedConfig, num_blocks: int) -> ThroughputInfo:
    """``settings.throughput`` as announced: a number as given, else measured (``auto``: cached) for ``num_blocks``.

    ``settings`` has its device, dtype and quantization decided already (see ``resolve_settings``).
    """
    requested = settings.throughput
    if isinstance(requested, ThroughputInfo):
        return requested
    if isinstance(requested, int | float):
        return ThroughputInfo(float(requested))
    if requested not in THROUGHPUT_CHOICES:
        raise SettingError("throughput", f"expected one of {', '.join(THROUGHPUT_CHOICES)} or a number")
    return get_server_throughput(
        config,
        settings.dtype,
        settings.device,
        num_blocks,
        settings.cache_dir or default_cache_dir(),
        force_eval=requested != "auto",
        quant_type=settings.quant_type,
        tensor_parallel_devices=settings.tensor_parallel_devices,
    )


def default_cache_dir() -> Path:
    """Where measurements are cached without ``--cache_dir``: ``$PETALS_CACHE``, else ``~/.cache/petals``."""
    return Path(os.environ.get("PETALS_CACHE", Path.home() / ".cache" / "petals"))


def get_server_throughput(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    cache_dir: Path,
    *,
    force_eval: bool = False,
    quant_type: QuantType | str = QuantType.NONE,
    tensor_parallel_devices: Sequence[torch.device] = (),
) -> ThroughputInfo:
    """Measured (or cached) compute throughput for ``num_blocks`` blocks of this model, converted as served."""
    conversion = {
        "quant_type": QuantType(quant_type),
        "tensor_parallel_devices": tuple(tensor_parallel_devices),
    }
    return _cached_rates(
        cache_dir,
        _cache_key(config, dtype, device, **conversion),
        lambda: _converted_random_block(config, dtype, device, **conversion),
        num_blocks,
        force_eval=force_eval,
    )


def hosted_throughput(
    backend: BlockBackend, settings: ServerSettings, config: PretrainedConfig, num_blocks: int, stored_as: str
) -> ThroughputInfo:
    """The throughput of blocks served packed, measured on one of them (``backend``, a loaded block):
    the random block ``get_server_throughput`` times holds dense weights, which a packed block computes
    several times faster than its own (it dequantizes per forward). Cached beside the dense figures, under
    the stored format."""
    key = _cache_key(
        config,
        settings.dtype,
        settings.device,
        QuantType(settings.quant_type),
        settings.tensor_parallel_devices,
    )
    return _cached_rates(
        settings.cache_dir or default_cache_dir(),
        f"{key}_packed_{stored_as.replace(' ', '_')}",
        lambda: backend,
        num_blocks,
        force_eval=False,
    )


def _cached_rates(
    cache_dir: Path, key: str, make_backend, num_blocks: int, *, force_eval: bool
) -> ThroughputInfo:
    """The rates under ``key`` in the cache file, measured on ``make_backend()`` when missing (or forced)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / "throughput.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # servers started together measure one after another
        cache_path = cache_dir / CACHE_FILE
        cache = _read_cache(cache_path)
        if force_eval or key not in cache:
            started = time.perf_counter()
            backend = make_backend()
            cache[key] = {
                "forward_rps": measure_compute_rps(backend, inference=False),
                "inference_rps": measure_compute_rps(backend, inference=True),
            }
            cache_path.write_text(json.dumps(cache, indent=2))
            logger.info(
                "Measured compute throughput in %.1f s: %s", time.perf_counter() - started, cache[key]
            )
    rates = cache[key]
    return ThroughputInfo(
        throughput=rates["forward_rps"] / ((num_blocks + 1) / 2),
        forward_rps=rates["forward_rps"],
        inference_rps=rates["inference_rps"],
    )


def _converted_random_block(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    quant_type: QuantType,
    tensor_parallel_devices: tuple[torch.device, ...],
) -> BlockBackend:
    block = make_block(config).to(dtype).eval().requires_grad_(False)  # on CPU: quantized on the move
    module = convert_block(
        block,
        0,
        config,
        dtype=dtype,
        device=device,
        quant_type=quant_type,
        tensor_parallel_devices=tensor_parallel_devices,
    )
    return BlockBackend("throughput.0", 0, module, config, dtype, device)


def measure_compute_rps(backend: BlockBackend, *, inference: bool) -> float:
    """Tokens per second through one block (random weights, converted as served)."""
    hidden_size, dtype, device = backend.config.hidden_size, backend.dtype, backend.device
    if inference:
        cache = backend.allocate_cache(1, INFERENCE_STEPS + 1)
        step = torch.randn(1, 1, hidden_size, dtype=dtype, device=device)
        backend.inference_step(step, None, cache.view())  # warm-up
        started = _now(device)
        for _ in range(INFERENCE_STEPS):
            backend.inference_step(step, None, cache.view())
        return INFERENCE_STEPS / (_now(device) - started)
    hidden = torch.randn(1, FORWARD_TOKENS, hidden_size, dtype=dtype, device=device)
    backend.forward(hidden, None)  # warm-up
    started = _now(device)
    for _ in range(FORWARD_STEPS):
        backend.forward(hidden, None)
    return FORWARD_STEPS * FORWARD_TOKENS / (_now(device) - started)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _cache_key(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    quant_type: QuantType,
    tensor_parallel_devices: tuple[torch.device, ...],
) -> str:
    devices = tensor_parallel_devices or (device,)
    device_name = "+".join(
        torch.cuda.get_device_name(d) if d.type == "cuda" else d.type for d in map(torch.device, devices)
    )
    shape = f"{config.model_type}_h{config.hidden_size}_i{getattr(config, 'intermediate_size', 0)}"
    return f"{shape}_device_{device_name}_dtype_{str(dtype).removeprefix('torch.')}_quant_{quant_type.value}"


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}
