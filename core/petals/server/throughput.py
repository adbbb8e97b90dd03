"""How many tokens per second this server can push through its blocks (announced for balancing).

``auto`` measures once and caches the numbers in ``<cache_dir>/throughput_v1.json`` (keyed by the
model's shape, device and dtype); ``eval`` measures again; a float is taken as given. We measure
compute only, on a block with random weights: a short timed forward of ``FORWARD_TOKENS`` tokens
(``forward_rps``) and single-token steps with a KV cache (``inference_rps``), both per block.
There is no internet speed test: the announced ``throughput`` is
``forward_rps / ((num_blocks + 1) / 2)``, the rate of a request crossing half the server's blocks
on average, as Petals computes it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from petals.block import allocate_cache, make_block

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


def get_server_throughput(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    cache_dir: Path,
    *,
    force_eval: bool = False,
) -> ThroughputInfo:
    """Measured (or cached) compute throughput for ``num_blocks`` blocks of this model."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = _cache_key(config, dtype, device)
    with open(cache_dir / "throughput.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # servers started together measure one after another
        cache_path = cache_dir / CACHE_FILE
        cache = _read_cache(cache_path)
        if force_eval or key not in cache:
            started = time.perf_counter()
            cache[key] = {
                "forward_rps": measure_compute_rps(config, dtype, device, inference=False),
                "inference_rps": measure_compute_rps(config, dtype, device, inference=True),
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


def measure_compute_rps(
    config: PretrainedConfig, dtype: torch.dtype, device: torch.device, *, inference: bool
) -> float:
    """Tokens per second through one block with random weights."""
    with torch.device(device):
        block = make_block(config).to(dtype).eval().requires_grad_(False)
    hidden_size = config.hidden_size
    with torch.no_grad():
        if inference:
            cache = allocate_cache(config, 1, INFERENCE_STEPS + 1, dtype, device)
            step = torch.randn(1, 1, hidden_size, dtype=dtype, device=device)
            block(step, cache)  # warm-up
            started = _now(device)
            for _ in range(INFERENCE_STEPS):
                block(step, cache)
            return INFERENCE_STEPS / (_now(device) - started)
        hidden = torch.randn(1, FORWARD_TOKENS, hidden_size, dtype=dtype, device=device)
        block(hidden, None)  # warm-up
        started = _now(device)
        for _ in range(FORWARD_STEPS):
            block(hidden, None)
        return FORWARD_STEPS * FORWARD_TOKENS / (_now(device) - started)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _cache_key(config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> str:
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    shape = f"{config.model_type}_h{config.hidden_size}_i{getattr(config, 'intermediate_size', 0)}"
    return f"{shape}_device_{device_name}_dtype_{str(dtype).removeprefix('torch.')}"


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}
