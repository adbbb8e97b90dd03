"""(a), (b) Per-token generation latency through a local swarm vs the same model in transformers.

    python -m benchmarks.generation_latency [--quick]

Greedy ``generate`` of a fixed number of new tokens after a 16-token prompt, with plain
transformers and with ``AutoDistributedModelForCausalLM`` (embeddings and LM head local, blocks on
the servers), taking turns in one process. Seconds per new token include the prefill and opening
the inference session: what a user waits for. Ratio = best swarm time / best local time.
The overhead over transformers is also printed as a multiple of the transport floor (one stream
round trip per server, ``transport_floor`` measured in the same run), and one more, traced run
(``petals.tracing``, servers started with ``PETALS_TRACE=1``) prints the mean decode step's time
as the client and each server measured it.
(a) tiny Llama (hidden 256, 8 layers, GQA 8/4, fp32), 2 servers x 4 blocks; Petals 2.2: 5.37x.
(b) SmolLM2-135M-Instruct (fp32), 3 servers x 10 blocks.
The ``_1t`` variants run the same with one torch thread everywhere (the local baseline, the client
and every server, via ``OMP_NUM_THREADS=1``): nothing else differs, so on a machine whose few cores
the client, servers and p2p daemons share, the ratio is not skewed by a baseline that gets all
cores to itself while the swarm's processes compete for them.
"""

from __future__ import annotations

import functools
import re
import sys

import torch

from benchmarks.harness import (
    Check,
    Context,
    Result,
    _with_threads,
    against_local,
    interleaved,
    main,
    summary,
)
from benchmarks.transport_floor import measure_floor


def generation_latency(
    ctx: Context, item: str, model: str, servers: int, goal: float, threads: int | None = None
) -> Result:
    new_tokens, repeats = ctx.pick((64, 5), (4, 1))
    local = ctx.local_model(model)
    remote = ctx.swarm(model, servers, threads).client()
    vocab_size = local.config.vocab_size
    prompt = torch.randint(3, vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    options = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=local.config.eos_token_id,
    )

    def generate(model) -> None:
        with torch.no_grad():
            output = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        assert output.shape[1] == prompt.shape[1] + new_tokens

    if threads is None:
        samples = against_local(lambda: generate(local), lambda: generate(remote), repeats)
    else:
        runs = {"local": lambda: generate(local), "swarm": lambda: generate(remote)}
        timed = interleaved({name: _with_threads(run, threads) for name, run in runs.items()}, repeats)
        samples = {name: summary(values) for name, values in timed.items()}
        samples["swarm"]["threads"] = threads
    per_token = {
        name: {key: value / new_tokens for key, value in result.items() if key in ("best", "median")}
        for name, result in samples.items()
    }
    client_threads = samples["swarm"]["threads"]
    thread_note = (
        f"the client at {client_threads} torch threads, the better"
        if threads is None
        else f"local, client and servers at {threads} torch thread(s)"
    )
    ratio = per_token["swarm"]["best"] / per_token["local"]["best"]
    overhead = per_token["swarm"]["best"] - per_token["local"]["best"]
    round_trip = measure_floor(ctx)["stream"]["median"]
    breakdown = traced_decode_step(_with_threads(lambda: generate(remote), client_threads))
    notes = [
        f"per token: local {per_token['local']['best'] * 1e3:.2f} ms, swarm {per_token['swarm']['best'] * 1e3:.2f} ms "
        f"(best of {repeats}; {thread_note}); overhead {overhead * 1e3:.2f} ms = {overhead / (servers * round_trip):.1f}x "
        f"the transport floor ({servers} servers x {round_trip * 1e3:.3f} ms stream round trip)",
        "traced decode step (mean ms, measured in the client and server processes):",
        *describe_breakdown(breakdown),
    ]
    return Result(
        item=item,
        title=f"per-token generation latency, {servers} servers ({model})"
        + ("" if threads is None else f", {threads} torch thread(s) everywhere"),
        ratio=ratio,
        baseline="transformers generate, same model, same process",
        checks=[Check("swarm / local seconds per token", ratio, goal, "<=")],
        measurements={
            "seconds_per_token": per_token,
            "seconds_per_run": samples,
            "client_threads": client_threads,
            "overhead_per_token_seconds": overhead,
            "transport_floor_seconds": servers * round_trip,
            "traced_decode_step_seconds": breakdown,
        },
        settings={
            "model": model,
            "servers": servers,
            "prompt_tokens": prompt.shape[1],
            "new_tokens": new_tokens,
            "repeats": repeats,
            "torch_threads": threads or "local: the better of 1 and all; servers: all",
        },
        notes=notes,
    )


def traced_decode_step(run) -> dict[str, float]:
    """Mean seconds per name over the decode steps (not the prefill) of one traced run."""
    from petals import tracing

    with tracing.collect() as steps:
        run()
    return tracing.means(steps[1:])


BLOCK = re.compile(r"^(server \d+/\d+): compute ")


def describe_breakdown(breakdown: dict[str, float]) -> list[str]:
    """One line per timing in the order recorded; a server's blocks summed into one line."""
    lines: dict[str, float] = {}
    blocks: dict[str, int] = {}
    for name, seconds in breakdown.items():
        match = BLOCK.match(name)
        if match:
            name = f"{match.group(1)}: compute"
            blocks[name] = blocks.get(name, 0) + 1
        lines[name] = lines.get(name, 0.0) + seconds
    return [
        f"  {name}: {seconds * 1e3:.2f}"
        + (f" ({blocks[name]} blocks, {seconds / blocks[name] * 1e3:.2f} each)" if name in blocks else "")
        for name, seconds in lines.items()
    ]


BENCHMARKS = {
    "latency_tiny_llama": functools.partial(
        generation_latency, item="a", model="tiny-llama", servers=2, goal=1.3
    ),
    "latency_smollm2": functools.partial(generation_latency, item="b", model="smollm2", servers=3, goal=1.2),
    # one torch thread everywhere; the floors: tiny Llama about 1.15x (2 hops of 0.46 ms on about 6 ms of compute)
    "latency_tiny_llama_1t": functools.partial(
        generation_latency, item="a", model="tiny-llama", servers=2, goal=1.25, threads=1
    ),
    "latency_smollm2_1t": functools.partial(
        generation_latency, item="b", model="smollm2", servers=3, goal=1.08, threads=1
    ),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
