"""(f) Many users per server: aggregate tokens/s of 8 concurrent sessions vs 1, and sessions admitted.

    python -m benchmarks.concurrent_sessions [--quick]

Throughput: SmolLM2-135M (real weights, 30 blocks) on 2 servers x 15 blocks, the check; then the
same on the tiny random Llama (2 x 4 blocks), reported beside it. Batching pays where a decode step
reads a lot of weights per token (every real model); the tiny Llama's blocks are so cheap that the
clients' own work per token dominates, so it shows the client side's ceiling. Eight client processes
(``benchmarks/session_client.py``), each with its own prompt length, start generating one after
another (``STAGGER`` s apart), each in its own inference session; then one of them alone, taking
turns. Ratio = (all new tokens / time from the first start to the last end) / (new tokens / time
of the one alone). The servers' counts of decode steps merged into one forward (sessions per
forward) over the concurrent rounds are reported with it. There is no transformers counterpart.

Admission: one server with a fixed KV-cache budget (``ADMISSION_BUDGET`` tokens per block) and
sessions that declare ``max_length`` 2048 but hold 512 tokens (a 511-token prefill and one step),
opened one after another and kept open until the server refuses one. Paged: counted on the
running server. Preallocated: what the previous rule (every session holds its whole
``max_length`` from its first step) admits under the same budget, ``budget // max_length``.
"""

from __future__ import annotations

import collections
import json
import statistics
import subprocess
import sys
from pathlib import Path

import psutil
import torch

from benchmarks.harness import Check, Context, Result, main

SESSIONS = 8
GOAL = 4.0
STAGGER = 0.05  # seconds between the concurrent sessions' starts
ADMISSION_BUDGET, ADMISSION_MAX_LENGTH, ADMISSION_TOKENS = 4096, 2048, 512


class SessionClients:
    """The client processes, ready to generate on ``go``; ``device`` holds each one's local parts."""

    def __init__(
        self,
        model_path: Path,
        initial_peers: list[str],
        new_tokens: int,
        count: int,
        stagger: float = STAGGER,
        device: str = "cpu",
    ) -> None:
        peers = json.dumps(initial_peers)
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.session_client",
                    str(model_path),
                    peers,
                    str(8 + 7 * index),  # prompts of 8 to 57 tokens
                    str(new_tokens),
                    str(stagger * index),
                    str(index),
                    device,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).parent.parent,
            )
            for index in range(count)
        ]
        for process in self.processes:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError("a session client failed to start; run benchmarks.session_client by hand")

    def generate(self, indices: list[int]) -> list[dict]:
        for index in indices:
            self.processes[index].stdin.write("go\n")
            self.processes[index].stdin.flush()
        return [json.loads(self.processes[index].stdout.readline()) for index in indices]

    def close(self) -> None:
        for process in self.processes:
            try:
                process.stdin.write("\n")
                process.stdin.flush()
                process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()
                process.wait()


def tokens_per_second(runs: list[dict]) -> float:
    return sum(run["tokens"] for run in runs) / (
        max(run["end"] for run in runs) - min(run["start"] for run in runs)
    )


def rates(samples: list[float]) -> dict:
    """Tokens/s samples: higher is better, so the best is the largest (``summary`` is for seconds)."""
    return {"best": max(samples), "median": statistics.median(samples), "samples": samples}


def merged_sizes(client, servers) -> collections.Counter:
    """Decode forwards by the number of sessions merged into them, summed over the servers."""
    sizes = collections.Counter()
    for server in servers:
        stats = client.info(server.peer_id)["stats"]
        prefix = "decode_batch_size_"
        sizes.update({int(key.removeprefix(prefix)): n for key, n in stats.items() if key.startswith(prefix)})
    return sizes


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children (p2p daemons) so far."""
    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for member in [process, *process.children(recursive=True)]:
                times = member.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def throughput(ctx: Context, model: str) -> dict:
    from petals.testing.wire_client import WireClient

    new_tokens, repeats, sessions = ctx.pick((48, 3, SESSIONS), (4, 1, 2))
    swarm = ctx.swarm(model, servers=2)
    clients = SessionClients(swarm.model_path, swarm.initial_peers, new_tokens, sessions)
    wire = WireClient(swarm.initial_peers)
    try:
        single, aggregate, merged = [], [], collections.Counter()
        groups = {
            "clients": [process.pid for process in clients.processes],
            "servers": [server.pid for server in swarm.servers],
        }
        cpu = collections.Counter()
        for _ in range(repeats):
            single.append(tokens_per_second(clients.generate([0])))
            before = merged_sizes(wire, swarm.servers)
            cpu_before = {name: cpu_seconds(pids) for name, pids in groups.items()}
            aggregate.append(tokens_per_second(clients.generate(list(range(sessions)))))
            cpu.update({name: cpu_seconds(pids) - cpu_before[name] for name, pids in groups.items()})
            merged += merged_sizes(wire, swarm.servers) - before
    finally:
        wire.close()
        clients.close()
    forwards = sum(merged.values())
    tokens = repeats * sessions * new_tokens
    return {
        # where the machine's CPU went while all sessions ran: ms per generated token, with p2pds
        "cpu_ms_per_token": {name: 1000 * seconds / tokens for name, seconds in cpu.items()},
        "new_tokens": new_tokens,
        "sessions": sessions,
        "tokens_per_second": {"1 session": rates(single), f"{sessions} sessions": rates(aggregate)},
        "ratio": max(aggregate) / max(single),
        "sessions_per_decode_forward": {
            "histogram": dict(sorted(merged.items())),
            "mean": sum(size * count for size, count in merged.items()) / forwards if forwards else 0.0,
        },
    }


def admission(ctx: Context) -> dict:
    from hivemind.p2p import P2PHandlerError

    from petals.data_structures import make_uids
    from petals.testing.swarm import running_swarm
    from petals.testing.wire_client import WireClient

    path = ctx.model_path("tiny-llama")
    num_blocks = ctx.num_blocks("tiny-llama")
    hidden_size = json.loads((path / "config.json").read_text())["hidden_size"]
    uids = make_uids(f"{path.name}-hf", 0, num_blocks)
    ctx.close_swarm()
    args = ("--throughput", "1", "--attn_cache_tokens", str(ADMISSION_BUDGET))
    args += ("--inference_max_length", str(ADMISSION_MAX_LENGTH), "--max_batch_size", "1024")
    with running_swarm(path, f"0:{num_blocks}", server_args=args) as (dht, (server,)):
        client = WireClient(dht.initial_peers)
        streams, refusal = [], None
        try:
            while refusal is None and len(streams) < 4 * ADMISSION_BUDGET // ADMISSION_TOKENS:
                stream = client.inference(server.peer_id, uids, max_length=ADMISSION_MAX_LENGTH)
                try:
                    stream.step(torch.randn(1, ADMISSION_TOKENS - 1, hidden_size))
                    stream.step(torch.randn(1, 1, hidden_size))
                    streams.append(stream)
                except P2PHandlerError as error:
                    refusal = str(error).splitlines()[0]
            for stream in streams:
                stream.close()
        finally:
            client.close()
    paged = len(streams)
    preallocated = ADMISSION_BUDGET // ADMISSION_MAX_LENGTH
    return {"paged": paged, "preallocated": preallocated, "ratio": paged / preallocated, "refusal": refusal}


def concurrent_sessions(ctx: Context) -> Result:
    tiny = throughput(ctx, "tiny-llama")  # first: the swarm latency_tiny_llama left running
    measured = throughput(ctx, "smollm2")
    admitted = admission(ctx)
    return Result(
        item="f",
        title=f"aggregate tokens/s of {SESSIONS} concurrent client processes / 1 session (SmolLM2-135M, 2 servers)",
        ratio=measured["ratio"],
        baseline="one session alone, same swarm",
        checks=[
            Check(f"{SESSIONS} sessions / 1 session tokens/s", measured["ratio"], GOAL, ">="),
            Check(
                f"{ADMISSION_TOKENS}-token sessions admitted, paged / preallocated",
                admitted["ratio"],
                GOAL,
                ">=",
            ),
        ],
        measurements={"throughput": measured, "throughput_tiny_llama": tiny, "admission": admitted},
        settings={
            "model": "smollm2 (the check); tiny-llama (reported beside it)",
            "servers": 2,
            "sessions": SESSIONS,
            "client_processes": SESSIONS,
            "prompt_lengths": [8 + 7 * index for index in range(SESSIONS)],
            "stagger_seconds": STAGGER,
            "admission": {
                "attn_cache_tokens": ADMISSION_BUDGET,
                "max_length": ADMISSION_MAX_LENGTH,
                "tokens_per_session": ADMISSION_TOKENS,
            },
        },
    )


BENCHMARKS = {"concurrent_sessions": concurrent_sessions}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
