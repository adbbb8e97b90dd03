"""(f) Aggregate generation throughput of 8 concurrent inference sessions vs 1 session.

    python -m benchmarks.concurrent_sessions [--quick]

Tiny Llama on 2 servers x 4 blocks. Eight client models (one shared network) each ``generate``
in their own thread, each in its own inference session, all at once; then one alone, taking turns.
Ratio = (8 x new tokens / wall time of all 8) / (new tokens / wall time of 1): how much more the
swarm serves when many users share it. There is no transformers counterpart.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.harness import Check, Context, Result, interleaved, main, summary

SESSIONS = 8
GOAL = 4.0


def concurrent_sessions(ctx: Context) -> Result:
    new_tokens, repeats = ctx.pick((32, 3), (4, 1))
    swarm = ctx.swarm("tiny-llama", servers=2)
    clients = [swarm.client() for _ in range(SESSIONS)]
    vocab_size = clients[0].config.vocab_size
    prompts = [
        torch.randint(3, vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed))
        for seed in range(SESSIONS)
    ]
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def generate(index: int) -> None:
        with torch.no_grad():
            clients[index].generate(prompts[index], **options)

    with ThreadPoolExecutor(SESSIONS) as pool:

        def all_sessions() -> None:
            list(pool.map(generate, range(SESSIONS)))

        samples = interleaved(
            {"1 session": lambda: generate(0), f"{SESSIONS} sessions": all_sessions}, repeats
        )
    seconds = {name: summary(values) for name, values in samples.items()}
    single = new_tokens / seconds["1 session"]["best"]
    aggregate = SESSIONS * new_tokens / seconds[f"{SESSIONS} sessions"]["best"]
    ratio = aggregate / single
    return Result(
        item="f",
        title=f"aggregate tokens/s of {SESSIONS} concurrent sessions / 1 session (tiny Llama, 2 servers)",
        ratio=ratio,
        baseline="one session alone, same swarm",
        checks=[Check(f"{SESSIONS} sessions / 1 session tokens/s", ratio, GOAL, ">=")],
        measurements={"seconds": seconds, "tokens_per_second": {"1 session": single, "aggregate": aggregate}},
        settings={"model": "tiny-llama", "servers": 2, "sessions": SESSIONS, "new_tokens": new_tokens},
    )


BENCHMARKS = {"concurrent_sessions": concurrent_sessions}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
