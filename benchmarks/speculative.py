"""Speculative decoding on a wide-area swarm: tokens per second with and without it.

    python -m benchmarks --only speculative [--quick]

Three servers split SmolLM2-135M-Instruct (fp32), each behind a ``DelayProxy`` holding every
message 20 ms per direction, as over a wide-area link. The client asks the model to edit a code
snippet (rename a variable and write the function again, after one worked example): the answer
repeats the input, which is what prompt lookup proposes. Greedy ``generate`` of a fixed number of new tokens, taking turns in
one run: plain, with prompt lookup, and with a local draft model (the same checkpoint cut to its
first blocks, so it shares the tokenizer; no smaller SmolLM2 exists offline). Every method must
return exactly the plain tokens. Ratio = speculative tokens/s over plain tokens/s through the same
swarm; the acceptance rate is the share of proposed tokens the swarm kept.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable

import torch
from transformers import AutoTokenizer

from benchmarks.harness import SERVER_ARGS, Check, Context, Result, interleaved, main, summary
from petals.formats.gguf import local_model

DELAY_MS = 20.0
SERVERS = 3
PROMPT_LOOKUP_TOKENS = 10
DRAFT_BLOCKS = 10  # of SmolLM2's 30
DRAFT_TOKENS = 4
EXAMPLE = """def average(values):
    count = len(values)
    return sum(values) / count
"""
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total * (1 + tax_rate)
"""
# one worked example, then the snippet to edit: the answer copies the snippet with the edit
REQUEST = (
    f"# Before:\n{EXAMPLE}# After renaming `count` to `n`:\n{EXAMPLE.replace('count', 'n')}\n"
    f"# Before:\n{CODE}# After renaming `total` to `subtotal`:\n"
)


def speculative(ctx: Context) -> Result:
    new_tokens, repeats = ctx.pick((48, 2), (8, 1))
    name = "smollm2"
    path = ctx.model_path(name)
    ctx.close_swarm()  # this benchmark runs its own wide-area swarm
    prompt = _prompt(ctx, path)
    draft = _draft(path, ctx.pick(DRAFT_BLOCKS, 2))
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    methods = {
        "plain": {},
        "prompt lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
        "draft model": {"assistant_model": draft},
    }
    with _wide_area_swarm(path, ctx.num_blocks(name), ctx.pick(SERVERS, 1)) as initial_peers:
        remote = _client(path, initial_peers)
        try:
            outputs, stats = {}, {}
            runs = {
                method: _generate(remote, prompt, {**options, **extra}, outputs, stats, method)
                for method, extra in methods.items()
            }
            samples = interleaved(runs, repeats)
        finally:
            remote.close()
    for method in methods:
        if not torch.equal(outputs[method], outputs["plain"]):
            raise AssertionError(f"{method} changed the greedy tokens")
    return _result(ctx, samples, stats, prompt.shape[1], new_tokens, repeats)


def _prompt(ctx: Context, path) -> torch.Tensor:
    if ctx.quick:  # a random model: a prompt that repeats itself gives prompt lookup something to find
        part = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
        return torch.cat([part, part, part], dim=1)
    return AutoTokenizer.from_pretrained(path)(REQUEST, return_tensors="pt")["input_ids"]


def _draft(path, blocks: int) -> torch.nn.Module:
    draft = local_model(path, dtype=torch.float32, num_hidden_layers=blocks)
    config = draft.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = DRAFT_TOKENS, "constant"
    config.assistant_confidence_threshold = 0.0  # always propose DRAFT_TOKENS
    return draft


@contextlib.contextmanager
def _wide_area_swarm(path, num_blocks: int, servers: int):
    """A DHT and ``servers`` float32 servers, each reachable only through its own delay proxy."""
    from petals.server.server import READY_MESSAGE
    from petals.testing.delay_proxy import start_server_behind_proxy
    from petals.testing.swarm import start_dht

    bounds = [round(i * num_blocks / servers) for i in range(servers + 1)]
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(start_dht())
        started = [
            stack.enter_context(
                start_server_behind_proxy(
                    path,
                    dht.initial_peers,
                    *("--block_indices", f"{start}:{end}", "--torch_dtype", "float32", *SERVER_ARGS),
                    delay_ms=DELAY_MS,
                    wait_ready=False,
                    wait_joined=False,
                    timeout=300,
                )
            )
            for start, end in itertools.pairwise(bounds)
        ]
        for server, _ in started:
            server.wait_for_log(READY_MESSAGE, timeout=300)
        yield dht.initial_peers


def _client(path, initial_peers):
    from petals import AutoDistributedModelForCausalLM
    from petals.testing.swarm import LOOPBACK_CLIENT

    return AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=initial_peers, **LOOPBACK_CLIENT
    )


def _generate(remote, prompt, options, outputs: dict, stats: dict, method: str) -> Callable[[], None]:
    from petals.client.generation import StepStats

    def run() -> None:
        with torch.no_grad(), StepStats(remote) as step_stats:
            outputs[method] = remote.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        stats[method] = step_stats

    return run


def _result(
    ctx: Context, samples: dict, stats: dict, prompt_length: int, new_tokens: int, repeats: int
) -> Result:
    seconds = {method: summary(values) for method, values in samples.items()}
    tokens_per_second = {method: new_tokens / result["best"] for method, result in seconds.items()}
    speedup = {method: rate / tokens_per_second["plain"] for method, rate in tokens_per_second.items()}
    acceptance = {method: stats[method].acceptance_rate(prompt_length, new_tokens) for method in stats}
    steps = {method: stats[method].steps for method in stats}
    return Result(
        item="s",
        title=f"speculative decoding, {ctx.pick(SERVERS, 1)} servers behind {DELAY_MS:.0f} ms proxies (smollm2)",
        ratio=speedup["prompt lookup"],
        baseline="plain greedy generate through the same wide-area swarm, same run",
        checks=[
            Check(
                f"prompt lookup / plain tokens per second (acceptance {_percent(acceptance['prompt lookup'])})",
                speedup["prompt lookup"],
                2.0,
                ">=",
            ),
            Check(
                f"draft model / plain tokens per second (reported; acceptance {_percent(acceptance['draft model'])})",
                speedup["draft model"],
                0.0,
                ">=",
            ),
        ],
        measurements={
            "tokens_per_second": tokens_per_second,
            "speedup": speedup,
            "acceptance_rate": acceptance,
            "steps_through_swarm": steps,
            "seconds_per_run": seconds,
        },
        settings={
            "servers": ctx.pick(SERVERS, 1),
            "delay_ms_per_direction": DELAY_MS,
            "prompt_tokens": prompt_length,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
            "draft": f"the same checkpoint, first {ctx.pick(DRAFT_BLOCKS, 2)} blocks, {DRAFT_TOKENS} tokens per step",
        },
    )


def _percent(rate: float | None) -> str:
    return "none proposed" if rate is None else f"{rate:.0%}"


BENCHMARKS = {"speculative": speculative}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
