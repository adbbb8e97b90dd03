"""What ``petals serve --metrics_port`` costs an inference step: per-token latency with metrics on vs off.

    python -m benchmarks.metrics_overhead [--quick] [--results DIR]

Two swarms of the tiny Llama (one server with all blocks each, on their own DHTs), identical but
for ``--metrics_port`` on one of them; one client per swarm, taking turns, greedy ``generate``
after a 16-token prompt. Nobody scrapes during the runs: this measures recording (a counter per
request, a histogram per step and per compute batch). Ratio = best time with metrics / without.
Not part of the default suite (``python -m benchmarks``), which holds the issue's six measurements.
"""

from __future__ import annotations

import contextlib
import socket
import sys

import torch

from benchmarks.harness import SERVER_ARGS, Check, Context, Result, interleaved, main, summary

GOAL = 1.05  # "nothing measurable": within the noise of this shared machine


def metrics_overhead(ctx: Context) -> Result:
    from petals import AutoDistributedModelForCausalLM
    from petals.testing.swarm import LOOPBACK_CLIENT, running_swarm

    new_tokens, repeats = ctx.pick((64, 5), (4, 1))
    ctx.close_swarm()
    path = ctx.model_path("tiny-llama")
    blocks = f"0:{ctx.num_blocks('tiny-llama')}"
    prompt = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with contextlib.ExitStack() as stack:
        clients = {}
        for name, extra in (("metrics off", ()), ("metrics on", ("--metrics_port", str(_free_port())))):
            dht, _ = stack.enter_context(running_swarm(path, blocks, server_args=(*SERVER_ARGS, *extra)))
            client = AutoDistributedModelForCausalLM.from_pretrained(
                path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
            stack.callback(client.remote_blocks.network.close)
            clients[name] = client

        def generate(name: str) -> None:
            with torch.no_grad():
                clients[name].generate(prompt, attention_mask=torch.ones_like(prompt), **options)

        samples = interleaved({name: lambda name=name: generate(name) for name in clients}, repeats)
    seconds = {name: summary(values) for name, values in samples.items()}
    ratio = seconds["metrics on"]["best"] / seconds["metrics off"]["best"]
    return Result(
        item="m",
        title="per-token generation latency with --metrics_port / without (tiny Llama, 1 server)",
        ratio=ratio,
        baseline="the same swarm without --metrics_port, same process, taking turns",
        checks=[Check("metrics on / off seconds per token", ratio, GOAL, "<=")],
        measurements={"seconds_per_run": seconds},
        settings={"model": "tiny-llama", "servers": 1, "prompt_tokens": 16, "new_tokens": new_tokens},
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


BENCHMARKS = {"metrics_overhead": metrics_overhead}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
