"""The compute a swarm cannot skip: a model's blocks and its client-side work per token, in one process.

    python -m benchmarks.compute_floor [tiny-llama|smollm2] [--quick]

A diagnostic, not part of the suite. It times, taking turns at 1 torch thread and at all of them:
transformers' ``generate`` per new token; transformers' decoder layers per decode step (the model
body with its ``DynamicCache``); and the same layers as a server runs them (``load_block`` into
``BlockBackend``s over paged caches, ``run_decode_steps``). What ``generate`` spends outside its
layers (embeddings, LM head, logits processing, its own logic) the swarm's client spends too.
So "client part + server blocks" is what a swarm's token costs before any transport: divided by
the best local time it bounds the latency ratio the swarm can reach on this machine. The server's
blocks are also timed with the process asleep before each step, as a swarm's server is while the
other hops run: what that idle time alone costs the next step on this machine; and with a process
spinning beside them, as a swarm's event loops and p2p daemons run beside a server's compute.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.harness import Context

STEPS, PROMPT = 64, 16
IDLE = 0.015  # about what a server of a 2-server swarm waits between its decode steps here


def timed(run, repeats: int = 3) -> float:
    """Best seconds per step of ``run()`` (which makes ``STEPS`` steps), after a warm-up."""
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - started) / STEPS)
    return best


@contextlib.contextmanager
def busy_neighbour():
    """A process spinning in pure Python (no memory traffic to speak of) beside the timed work, as a swarm's
    event loops and p2p daemons run beside a server's compute."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # running
        yield
    finally:
        spinner.kill()
        spinner.wait()


def server_backends(path: Path):
    from petals.auto import AutoDistributedConfig
    from petals.loading import load_block
    from petals.server.backend import BlockBackend

    config = AutoDistributedConfig.from_pretrained(path)
    backends = []
    for index in range(config.num_hidden_layers):
        block = load_block(path, index, torch.float32, config=config)
        backends.append(
            BlockBackend(f"block.{index}", index, block, block.config, torch.float32, torch.device("cpu"))
        )
    return config, backends


def main() -> None:
    from petals.server.sessions import DecodeStep, ServerInferenceSession, run_decode_steps

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="tiny-llama", choices=("tiny-llama", "smollm2"))
    parser.add_argument("--quick", action="store_true", help="the suite's --quick model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        ctx = Context(quick=args.quick, workdir=Path(workdir))
        local = ctx.local_model(args.model)
        config, backends = server_backends(ctx.model_path(args.model))
        pools = [
            backend.make_pools(tokens=((PROMPT + STEPS) // 16 + 2) * 16, page_tokens=16)
            for backend in backends
        ]
        vocab, hidden_size = config.vocab_size, config.hidden_size
        prompt = torch.randint(3, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0))

        def generate() -> None:
            with torch.no_grad():
                local.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=STEPS,
                    min_new_tokens=STEPS,
                    do_sample=False,
                    pad_token_id=0,
                )

        def transformers_layers() -> None:
            cache = DynamicCache(config=local.config)
            with torch.inference_mode():
                local.model(prompt, cache=cache, use_cache=True)
                for token in torch.randint(3, vocab, (STEPS, 1, 1)):
                    local.model(token, cache=cache, use_cache=True)

        def server_blocks(idle: float = 0.0) -> float:
            """Seconds in the decode steps; ``idle``: seconds asleep before each (as a swarm's server waits
            for the other hops), not counted."""
            caches = [
                backend.open_cache(pool, 1, PROMPT + STEPS)
                for backend, pool in zip(backends, pools, strict=True)
            ]
            session = ServerInferenceSession("floor", backends, caches, 1, PROMPT + STEPS)
            session.run_blocks(torch.randn(1, PROMPT, hidden_size), [None] * len(backends))
            seconds = 0.0
            for hidden in torch.randn(STEPS, 1, 1, hidden_size):
                time.sleep(idle)
                started = time.perf_counter()
                run_decode_steps([DecodeStep(session, hidden, None, None)])
                seconds += time.perf_counter() - started
            session.end("measured")
            return seconds

        all_threads = torch.get_num_threads()
        rows = {}
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            rows[threads] = {
                name: timed(run)
                for name, run in (
                    ("generate", generate),
                    ("layers", transformers_layers),
                    ("server", server_blocks),
                )
            }
            server_blocks(IDLE)  # warm-up
            rows[threads]["server after idle"] = min(server_blocks(IDLE) for _ in range(3)) / STEPS
            with busy_neighbour():
                rows[threads]["server beside a busy core"] = min(server_blocks() for _ in range(3)) / STEPS
        torch.set_num_threads(all_threads)
    best_local = min(row["generate"] for row in rows.values())
    client = min(row["generate"] - row["layers"] for row in rows.values())
    print(
        f"{ctx.model_path(args.model).name}, {config.num_hidden_layers} blocks, ms per token (best of 3 x {STEPS} steps):"
    )
    for threads, row in rows.items():
        print(
            f"  {threads} threads: transformers generate {row['generate'] * 1e3:.2f}, its layers "
            f"{row['layers'] * 1e3:.2f}, outside its layers {(row['generate'] - row['layers']) * 1e3:.2f}; "
            f"the server's blocks {row['server'] * 1e3:.2f} ({row['server'] / row['layers']:.2f}x its layers), "
            f"the same after {IDLE * 1e3:.0f} ms idle before each step {row['server after idle'] * 1e3:.2f} "
            f"({row['server after idle'] / row['server']:.2f}x), with a busy process beside it "
            f"{row['server beside a busy core'] * 1e3:.2f} ({row['server beside a busy core'] / row['server']:.2f}x)"
        )
    for threads, row in rows.items():
        floor = client + row["server"]
        print(
            f"  swarm before transport, servers at {threads} threads: {floor * 1e3:.2f} ms = "
            f"{floor / best_local:.2f}x the best local generate ({best_local * 1e3:.2f} ms)"
        )


if __name__ == "__main__":
    main()
