"""What every benchmark shares: models, a running swarm, interleaved timing, results as JSON.

A benchmark is a function ``run(ctx: Context) -> Result``. ``main`` runs a selection of them one
after another in this process (never in parallel), writes ``<results>/<name>.json`` for each, and
renders the summary table and chart (``benchmarks/report.py``). In ``--quick`` mode every model is
a very small random Llama and every timing runs once: it checks that the suite works, not how fast.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from petals.formats.gguf import local_model

RESULTS_DIR = Path(__file__).parent / "results"
# beyond running_swarm's float32: a fixed throughput, so no server measures its own at start
SERVER_ARGS = ("--throughput", "1")
# servers time the steps whose request asks for it (the latency benchmarks' traced run), no others
TRACING_SERVERS = {"PETALS_TRACE": "1"}

# (a), (d), (f): the tiny Llama Petals 2.2 was measured with (5.37x per-token latency here)
TINY_LLAMA = LlamaConfig(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=512,
    vocab_size=32000,
)
# --quick: every model is this one (6 layers: splits over 1, 2 or 3 servers)
QUICK_LLAMA = LlamaConfig(
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
)


@dataclass
class Check:
    """One goal: ``value <op> goal``, e.g. a ratio ``<= 1.5`` or a count ``<= 3``."""

    name: str
    value: float
    goal: float
    op: str  # "<=" or ">="
    unit: str = "x"

    @property
    def met(self) -> bool:
        return self.value <= self.goal if self.op == "<=" else self.value >= self.goal


@dataclass
class Result:
    """What a benchmark measured. ``ratio`` is its headline number (product vs its baseline)."""

    item: str  # the letter, (a) to (f): the order of the summary
    title: str
    ratio: float
    baseline: str  # what the ratio divides by
    checks: list[Check]
    measurements: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed under the result (e.g. a latency breakdown)


Benchmark = Callable[["Context"], Result]


# ---- timing --------------------------------------------------------------------------------------


def interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function: one warm-up each, then ``repeats`` rounds taking turns.

    Taking turns spreads the load of this shared machine evenly over product and baseline.
    """
    for run in runs.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    return samples


def against_local(local: Callable[[], object], swarm: Callable[[], object], repeats: int) -> dict[str, Any]:
    """``interleaved`` timings of the local baseline and of the swarm, each at 1 and at all torch threads.

    On a loaded 2-core machine, torch's thread pool stalls when another process takes a core; the
    baseline is credited with its better thread count (``local``), so ratios never flatter us. The
    swarm's client gets the same choice (``swarm``): here it shares the cores with the servers, and
    its idle OpenMP workers spin on a core the servers need (``threads``: the count credited).
    """
    counts = sorted({1, torch.get_num_threads()})
    variants = {f"local, {count} threads": _with_threads(local, count) for count in counts}
    swarms = {f"swarm, {count} threads": _with_threads(swarm, count) for count in counts}
    samples = {name: summary(values) for name, values in interleaved({**variants, **swarms}, repeats).items()}
    samples["local"] = min((samples[name] for name in variants), key=lambda result: result["best"])
    best_swarm = min(swarms, key=lambda name: samples[name]["best"])
    samples["swarm"] = {**samples[best_swarm], "threads": counts[list(swarms).index(best_swarm)]}
    return samples


def _with_threads(run: Callable[[], object], count: int) -> Callable[[], object]:
    def wrapped() -> object:
        previous = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            return run()
        finally:
            torch.set_num_threads(previous)

    return wrapped


def summary(samples: list[float]) -> dict[str, Any]:
    """Best (the headline: load on a shared machine only ever adds time), median and all samples."""
    return {"best": min(samples), "median": statistics.median(samples), "samples": samples}


# ---- models and swarms ---------------------------------------------------------------------------


@dataclass
class Swarm:
    """A running ``petals dht`` + servers for one model, and the clients connected to it."""

    model_path: Path
    initial_peers: list[str]
    servers: list[Any]
    clients: list[Any] = field(default_factory=list)

    def client(self, share_network: bool = True):
        """A new ``AutoDistributedModelForCausalLM``; after the first, they share its network."""
        from petals import AutoDistributedModelForCausalLM
        from petals.testing.swarm import LOOPBACK_CLIENT

        network = self.clients[0].remote_blocks.network if self.clients and share_network else None
        model = AutoDistributedModelForCausalLM.from_pretrained(
            self.model_path, initial_peers=self.initial_peers, network=network, **LOOPBACK_CLIENT
        )
        self.clients.append(model)
        return model

    def close_clients(self) -> None:
        networks = {id(model.remote_blocks.network): model.remote_blocks.network for model in self.clients}
        for network in networks.values():
            network.close()
        self.clients.clear()


def server_env(threads: int | None) -> dict[str, str]:
    """The servers' environment: tracing on request, and ``threads`` torch threads if given."""
    return TRACING_SERVERS if threads is None else {**TRACING_SERVERS, "OMP_NUM_THREADS": str(threads)}


def block_ranges(num_blocks: int, servers: int) -> list[str]:
    """``"start:end"`` for each of ``servers`` servers splitting ``num_blocks`` blocks evenly."""
    bounds = [round(i * num_blocks / servers) for i in range(servers + 1)]
    return [f"{start}:{end}" for start, end in itertools.pairwise(bounds)]


class Context:
    """Models, the local baselines and at most one running swarm, shared by consecutive benchmarks."""

    def __init__(self, quick: bool, workdir: Path) -> None:
        self.quick = quick
        self.workdir = workdir
        self._paths: dict[str, Path] = {}
        self._local: dict[str, torch.nn.Module] = {}
        self._swarm: tuple[tuple[str, int, int | None], Swarm, contextlib.ExitStack] | None = None
        self.shared: dict[str, Any] = {}  # measurements later benchmarks of the run reuse (transport floor)
        self.server_args = SERVER_ARGS  # every server's options beyond running_swarm's (float32)

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full

    def model_path(self, name: str) -> Path:
        """``"tiny-llama"`` (random, saved here) or ``"smollm2"`` (SmolLM2-135M-Instruct, fp32)."""
        if self.quick:
            name = "quick-llama"
        if name not in self._paths:
            if name == "smollm2":
                from petals.demo_model import prepare_demo_model

                self._paths[name] = prepare_demo_model()
            else:
                config = {"tiny-llama": TINY_LLAMA, "quick-llama": QUICK_LLAMA}[name]
                torch.manual_seed(0)
                path = self.workdir / name
                AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
                self._paths[name] = path
        return self._paths[name]

    def num_blocks(self, name: str) -> int:
        """Its layers, read as a server reads its config (the demo model's is inside its GGUF file)."""
        from petals.auto import AutoDistributedConfig

        return AutoDistributedConfig.from_pretrained(self.model_path(name)).num_hidden_layers

    def local_model(self, name: str) -> torch.nn.Module:
        """Plain transformers, fp32, in this process: the baseline."""
        path = self.model_path(name)
        if path not in self._local:
            self._local[path] = local_model(path, dtype=torch.float32)
        return self._local[path]

    def swarm(self, name: str, servers: int, threads: int | None = None) -> Swarm:
        """``servers`` float32 servers splitting the model's blocks evenly, on their own DHT.

        ``threads``: each server's torch threads (``OMP_NUM_THREADS``), else torch's default.
        The swarm stays up for the next benchmark asking for the same one; any other is stopped first.
        With ``--quick``, every swarm is one server at torch's default threads (so all benchmarks share it).
        """
        from petals.testing.swarm import running_swarm

        servers, threads = self.pick(servers, 1), self.pick(threads, None)
        key = (str(self.model_path(name)), servers, threads)
        if self._swarm is not None and self._swarm[0] == key:
            return self._swarm[1]
        self.close_swarm()
        path = self.model_path(name)
        ranges = block_ranges(self.num_blocks(name), servers)
        stack = contextlib.ExitStack()
        dht, processes = stack.enter_context(
            running_swarm(path, *ranges, server_args=self.server_args, env=server_env(threads))
        )
        swarm = Swarm(path, dht.initial_peers, processes)
        stack.callback(swarm.close_clients)
        self._swarm = (key, swarm, stack)
        return swarm

    def close_swarm(self) -> None:
        if self._swarm is not None:
            self._swarm[2].close()
            self._swarm = None

    def drop_local_models(self) -> None:
        self._local.clear()
        gc.collect()

    def release(self) -> None:
        self.close_swarm()
        self.drop_local_models()


# ---- results -------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import hivemind
    import transformers

    cpu_model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu_model,
        "logical_cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "hivemind": hivemind.__version__,
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit or None


def write_result(name: str, result: Result, results_dir: Path, command: str, quick: bool) -> dict[str, Any]:
    record = {
        "benchmark": name,
        "item": result.item,
        "title": result.title,
        "ratio": result.ratio,
        "baseline": result.baseline,
        "checks": [{**asdict(check), "met": check.met} for check in result.checks],
        "met": all(check.met for check in result.checks),
        "quick": quick,
        "measurements": result.measurements,
        "settings": result.settings,
        "notes": result.notes,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


# ---- command line --------------------------------------------------------------------------------


def main(benchmarks: dict[str, Benchmark], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run petals-core benchmarks; print ratios vs transformers.")
    parser.add_argument("--quick", action="store_true", help="tiny models, one run each: a smoke test")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help=f"output folder ({RESULTS_DIR})")
    parser.add_argument("--only", nargs="+", choices=list(benchmarks), metavar="NAME", help="a subset")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", _entry_module(), *(sys.argv[1:] if argv is None else argv)])

    from benchmarks import report

    failed = []
    with tempfile.TemporaryDirectory(prefix="petals-bench-") as workdir:
        ctx = Context(args.quick, Path(workdir))
        try:
            for name, benchmark in benchmarks.items():
                if args.only and name not in args.only:
                    continue
                print(f"== {name}", flush=True)
                try:
                    record = write_result(name, benchmark(ctx), args.results, command, args.quick)
                except Exception:
                    traceback.print_exc()
                    failed.append(name)
                    continue
                print(report.describe(record), flush=True)
        finally:
            ctx.release()
    table = report.render(args.results)
    print(table)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _entry_module() -> str:
    main_module = sys.modules["__main__"]
    spec = getattr(main_module, "__spec__", None)
    name = spec.name if spec is not None else "benchmarks"
    return name.removesuffix(".__main__")
