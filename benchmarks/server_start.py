"""(d) Seconds from starting ``petals serve`` to its blocks being ONLINE in the DHT.

    python -m benchmarks.server_start [--quick]

One server hosting all blocks of the tiny Llama (fp32, fixed throughput) joins a local bootstrap
peer; the time runs from spawning the process to its "ONLINE" log line, best of several starts.
There is no transformers counterpart; for scale, the ratio divides by the time a bare
``python -c "import torch, transformers"`` takes on the same machine.
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.harness import SERVER_ARGS, Check, Context, Result, main, summary

GOAL_SECONDS = 3.0


def bare_import_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True)
    return time.perf_counter() - started


def server_start(ctx: Context) -> Result:
    from petals.testing.swarm import start_dht, start_server

    starts = ctx.pick(5, 1)
    ctx.close_swarm()  # nothing else running while we time
    path = ctx.model_path("tiny-llama")
    blocks = f"0:{ctx.num_blocks('tiny-llama')}"
    bare_import_seconds()  # warm-up: the page cache holds the libraries for both measurements
    online, imports = [], []
    with start_dht() as dht:
        for _ in range(starts):
            imports.append(bare_import_seconds())
            args = ("--block_indices", blocks, "--torch_dtype", "float32", *SERVER_ARGS)
            with start_server(path, dht.initial_peers, *args, timeout=120) as server:
                online.append(server.ready_seconds)
    seconds = summary(online)["best"]
    bare = summary(imports)["best"]
    return Result(
        item="d",
        title="server start to ONLINE (tiny Llama, all blocks)",
        ratio=seconds / bare,
        baseline='python -c "import torch, transformers"',
        checks=[Check("start to ONLINE", seconds, GOAL_SECONDS, "<=", unit="s")],
        measurements={"start_to_online_seconds": summary(online), "bare_import_seconds": summary(imports)},
        settings={"model": "tiny-llama", "blocks": blocks, "starts": starts, "server_args": SERVER_ARGS},
    )


BENCHMARKS = {"server_start": server_start}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
