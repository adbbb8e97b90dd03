"""(c) Forward throughput of a token batch through a local swarm vs a local transformers forward.

    python -m benchmarks.forward_throughput [--quick]

``model(input_ids)`` outside an inference session (the servers' ``rpc_forward``) on SmolLM2-135M-
Instruct served by 3 servers x 10 blocks, against the same call on the transformers model, taking
turns in one process, for a [2, 16] and a [1, 512] batch. Ratio = best swarm time / best local time
(= local tokens/s / swarm tokens/s); the headline is the worse of the two shapes.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.harness import Check, Context, Result, against_local, main

SHAPES = ((2, 16), (1, 512))
GOAL = 1.2


def forward_throughput(ctx: Context) -> Result:
    repeats = ctx.pick(5, 1)
    local = ctx.local_model("smollm2")
    remote = ctx.swarm("smollm2", servers=3).client()
    generator = torch.Generator().manual_seed(0)
    checks, measurements = [], {}
    for batch, length in SHAPES:
        input_ids = torch.randint(3, local.config.vocab_size, (batch, length), generator=generator)

        def forward(model, input_ids=input_ids) -> None:
            with torch.no_grad():
                model(input_ids, use_cache=False)

        seconds = against_local(lambda: forward(local), lambda: forward(remote), repeats)
        tokens_per_second = {name: batch * length / seconds[name]["best"] for name in ("local", "swarm")}
        ratio = seconds["swarm"]["best"] / seconds["local"]["best"]
        checks.append(Check(f"[{batch}, {length}] swarm / local forward time", ratio, GOAL, "<="))
        measurements[f"{batch}x{length}"] = {"seconds": seconds, "tokens_per_second": tokens_per_second}
    return Result(
        item="c",
        title="forward throughput, 3 servers (smollm2), [2, 16] and [1, 512] tokens",
        ratio=max(check.value for check in checks),
        baseline="transformers forward, same model, same process",
        checks=checks,
        measurements=measurements,
        settings={"model": "smollm2", "servers": 3, "shapes": SHAPES, "repeats": repeats},
    )


BENCHMARKS = {"forward_throughput": forward_throughput}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
