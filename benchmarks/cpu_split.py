"""Where the CPU goes while a local swarm generates: CPU and run-queue wait per token, per thread.

    python -m benchmarks.cpu_split [tiny-llama|smollm2] [SERVERS] [--client_threads N] [--server_threads N] [--quick]

A diagnostic, not part of the suite (no ratio, no goal; Linux only). It starts the same swarm as the
latency benchmarks, generates 64 greedy tokens through it and with plain transformers, and reads
``/proc/<pid>/task/<tid>/schedstat`` of every thread of this process (the client), of each server
and of their p2p daemons before and after: time on a CPU, and time spent runnable but waiting for
one. On a machine where the client and the servers share few cores, the waits show who took the
cores the critical path needed (e.g. a client's idle OpenMP worker spinning while servers compute).
Each thread's page faults (``stat``) and moves from one CPU to another (``sched``'s ``nr_migrations``:
its caches stay behind) per token come with it, events a VM without hardware counters still counts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import psutil
import torch

from benchmarks.harness import Context

NEW_TOKENS = 64


def descendants(pid: int) -> list[int]:
    """``pid`` and its children, recursively."""
    process = psutil.Process(pid)
    return [pid, *(child.pid for child in process.children(recursive=True))]


def thread_times(groups: dict[str, list[int]]) -> dict[tuple[str, str, int], tuple[int, int, int, int]]:
    """``(group, process name, thread id) -> (ns on a CPU, ns waiting to run, page faults, CPU
    migrations)`` for every thread."""
    times = {}
    for group, pids in groups.items():
        for pid in pids:
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                for tid in os.listdir(f"/proc/{pid}/task"):
                    task = Path(f"/proc/{pid}/task/{tid}")
                    running, waiting, _ = (task / "schedstat").read_text().split()
                    stat = (task / "stat").read_text().rsplit(")", 1)[1].split()  # fields after the name
                    faults = int(stat[7]) + int(stat[9])  # minflt, majflt
                    times[(group, name, int(tid))] = (int(running), int(waiting), faults, _migrations(task))
            except OSError:  # a process or thread that ended
                continue
    return times


def _migrations(task: Path) -> int:
    for line in (task / "sched").read_text().splitlines():
        if line.startswith("se.nr_migrations"):
            return int(line.split(":")[1])
    return 0


def report(label: str, seconds: float, before: dict, after: dict) -> None:
    print(f"== {label}: {seconds / NEW_TOKENS * 1e3:.2f} ms per token")
    total = 0
    for key in sorted(after):
        running, waiting, faults, migrations = (
            now - then for now, then in zip(after[key], before.get(key, (0, 0, 0, 0)), strict=True)
        )
        total += running
        if max(running, waiting) / NEW_TOKENS > 0.1e6:  # threads that did something
            group, name, tid = key
            print(
                f"  {group:8} {name:8} thread {tid}: CPU {running / NEW_TOKENS / 1e6:.2f} ms/token, "
                f"waiting for a CPU {waiting / NEW_TOKENS / 1e6:.2f} ms/token, "
                f"{faults / NEW_TOKENS:.1f} page faults and {migrations / NEW_TOKENS:.2f} CPU moves per token"
            )
    print(f"  all threads: CPU {total / NEW_TOKENS / 1e6:.2f} ms/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="tiny-llama", choices=("tiny-llama", "smollm2"))
    parser.add_argument("servers", nargs="?", type=int, default=2)
    parser.add_argument("--client_threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--server_threads", type=int, help="each server's torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="the suite's --quick model, one server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        ctx = Context(quick=args.quick, workdir=Path(workdir))
        try:
            swarm = ctx.swarm(args.model, args.servers, args.server_threads)
            models = {"swarm": swarm.client(), "local transformers": ctx.local_model(args.model)}
            groups = {
                f"server {index}": descendants(server.pid) for index, server in enumerate(swarm.servers)
            }
            in_servers = {pid for pids in groups.values() for pid in pids}
            groups["client"] = [pid for pid in descendants(os.getpid()) if pid not in in_servers]
            prompt = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
            options = dict(
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            torch.set_num_threads(args.client_threads)
            for label, model in models.items():
                with torch.no_grad():
                    model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)  # warm-up
                    before, started = thread_times(groups), time.perf_counter()
                    model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
                    seconds, after = time.perf_counter() - started, thread_times(groups)
                report(f"{label}, client at {args.client_threads} torch threads", seconds, before, after)
        finally:
            ctx.release()


if __name__ == "__main__":
    main()
