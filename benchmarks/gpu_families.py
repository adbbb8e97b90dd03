"""One worker of the GPU check's family correctness (``benchmarks.gpu``'s correctness section).

    python -m benchmarks.gpu_families --device cuda --dtypes float16 bfloat16 --json PART.json \\
        --workdir DIR MODEL_TYPE ...

For each model type (a tiny random model of ``benchmarks.tiny_families``, or ``smollm2``: the demo's
model), two servers per dtype (blocks 0:2 and 2:4, each with its own p2p daemon) join a ``petals dht``
of this worker's as in-process peers of this process (``petals.testing.inprocess``): one Python
start, one torch import and one CUDA context serve many families, where a ``petals serve`` per
server would start 160 processes. Then each model's greedy tokens and per-step logits go through its two servers against
transformers on the same device in the same dtype (``benchmarks.gpu.greedy_and_steps`` and ``judge``).
The JSON is rewritten after each check; ``--outputs`` keeps each check's tensors for the section's
tensor-parallel comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import (
    REAL_MODEL,
    Clients,
    OnDevice,
    _brief,
    _one_line,
    _seeded,
    greedy_and_steps,
    judge,
    local_model,
    log,
    save_random,
)
from benchmarks.harness import block_ranges
from benchmarks.tiny_families import CONFIGS, cache_kinds, tiny_config

WAVE = 8  # servers loading and joining at once: more, and their DHT pings time out on a busy GIL


def prepare(name: str, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The model folder of ``name`` and what the report says of it (its cache kinds, what it switches on)."""
    if name == REAL_MODEL:
        from petals import AutoDistributedConfig
        from petals.demo_model import prepare_demo_model

        path = prepare_demo_model()  # a GGUF file, whose config transformers alone does not read
        config = AutoDistributedConfig.from_pretrained(path)
        return path, {"cache_kinds": cache_kinds(config), "model": "SmolLM2-135M-Instruct"}
    config = tiny_config(name)
    save_random(config, workdir / name, torch.float32, torch.device("cpu"))
    return workdir / name, {"cache_kinds": cache_kinds(config), "switched_on": CONFIGS[name][2]}


@contextlib.contextmanager
def serving(
    peers: list[str], launches: dict[str, tuple[Path, tuple[tuple[str, ...], ...]]]
) -> Iterator[dict[str, str]]:
    """An in-process server per launch's argument list (dht prefix -> model, arguments of each server),
    joining ``peers``, loading ``WAVE`` at a time; one that fails to start gets a second try (a join
    can time out on a busy machine). Yields the prefixes whose servers failed, with why."""
    from petals.testing.inprocess import InProcessServer

    servers: list[InProcessServer] = []  # every one made, stopped on exit
    failed: dict[str, str] = {}

    def start(launch: list[tuple[str, Path, tuple[str, ...]]]) -> list[tuple[str, Path, tuple[str, ...]]]:
        """Start ``launch``'s servers together; those that did not become ready, to retry."""
        made = []
        for prefix, path, args in launch:
            try:
                server = InProcessServer(path, peers, "--dht_prefix", prefix, "--throughput", "1", *args)
                servers.append(server.start(wait=False))
                made.append(((prefix, path, args), server))
            except Exception as error:  # its settings refused
                failed[prefix] = _one_line(error)
        again = []
        for item, server in made:
            try:
                server.wait_ready()
            except RuntimeError as error:
                failed[item[0]] = _one_line(error.__cause__ or error)
                again.append(item)
        return again

    todo = [(prefix, path, args) for prefix, (path, arguments) in launches.items() for args in arguments]
    try:
        again = [item for wave in range(0, len(todo), WAVE) for item in start(todo[wave : wave + WAVE])]
        for prefix, _, _ in again:
            failed.pop(prefix, None)
        for wave in range(0, len(again), WAVE):
            start(again[wave : wave + WAVE])
        log(f"{len(todo)} in-process servers started ({len(again)} twice); {len(failed)} models' failed")
        yield failed
    finally:
        _stop_all(servers)


def _stop_all(servers: list) -> None:
    """All at once, each announcing that it leaves."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(_stop, servers))


def _stop(server) -> None:
    with contextlib.suppress(RuntimeError):
        server.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from petals.testing.swarm import start_dht

    device = torch.device(args.device)
    record: dict[str, Any] = {"families": {}, "models": {}, "not_run": {}}

    def write() -> None:
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")

    paths = {}
    for name in args.names:
        try:
            paths[name], record["models"][name] = prepare(name, args.workdir)
        except Exception as error:
            traceback.print_exc()
            record["not_run"][name] = _one_line(error)
    on_device = ("--device", str(device), "--quant_type", "none")
    launches = {
        f"{name}-{dtype}": (
            path,
            tuple(
                ("--block_indices", blocks, "--torch_dtype", dtype, *on_device)
                for blocks in block_ranges(4 if name != REAL_MODEL else _num_blocks(path), 2)
            ),
        )
        for name, path in paths.items()
        for dtype in args.dtypes
    }
    # a bootstrap peer of its own: the servers of 4 workers joining one (on 2 cores) timed out on its pings
    with start_dht() as dht, serving(dht.initial_peers, launches) as failed:
        clients = Clients(dht.initial_peers, device)
        try:
            for name, path in paths.items():
                for dtype_name in args.dtypes:
                    result = check_model(args, clients, path, f"{name}-{dtype_name}", failed)
                    record["families"][f"{name} {dtype_name}"] = result
                    log(f"{name} {dtype_name}: {_brief(result)}")
                    write()
        finally:
            clients.close()
    write()
    return record


def check_model(args: argparse.Namespace, clients: Clients, path: Path, prefix: str, failed: dict) -> dict:
    """Greedy tokens and per-step logits of the model at ``path`` through the servers of ``prefix``
    (``name-dtype``) against transformers, judged within the dtype's tolerance."""
    from petals.client.verification import TOLERANCES

    started, dtype_name = time.monotonic(), prefix.rsplit("-", 1)[1]
    try:
        if prefix in failed:
            raise RuntimeError(f"a server of {prefix} did not start: {failed[prefix]}")
        dtype, device = getattr(torch, dtype_name), torch.device(args.device)
        local = OnDevice(local_model(path, dtype, device), device)
        remote = clients.get(path, prefix, dtype)
        ids = torch.randint(3, 1000, (1, args.prompt), generator=_seeded(1))
        outputs = greedy_and_steps(local, remote, ids, args.tokens)
        result = judge(outputs, ids.shape[1], TOLERANCES[dtype_name])
        if args.outputs is not None:
            torch.save({key: value.cpu() for key, value in outputs.items()}, args.outputs / f"{prefix}.pt")
    except Exception as error:
        traceback.print_exc()
        result = {"passed": False, "error": _one_line(error)}
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def _num_blocks(path: Path) -> int:
    from petals import AutoDistributedConfig

    return AutoDistributedConfig.from_pretrained(path).num_hidden_layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", choices=[*CONFIGS, REAL_MODEL], metavar="MODEL_TYPE")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32"], choices=["float16", "bfloat16", "float32"]
    )
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True, help="where the tiny models are saved")
    parser.add_argument("--outputs", type=Path, default=None, help="keep each check's tensors here")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    record = run(args)
    failed = [key for key, result in record["families"].items() if not result.get("passed")]
    return 1 if failed or record["not_run"] else 0


if __name__ == "__main__":
    sys.exit(main())
