"""Where a wide-area token's time goes, hop by hop: every chunk through the delay proxies, on a timeline.

    python -m benchmarks.wan_timeline [--delay_ms 20] [--tokens 12] [--shown 3] [--no_push] [--quick]

A diagnostic, not part of the suite (no ratio, no goal). It starts ``wan_latency``'s swarm (the tiny
Llama on 3 servers, each reachable only through a ``DelayProxy``), generates greedily with push on,
and records each chunk the proxies forward (``DelayProxy.events``: when it arrived, was due and was
written) and the moment each token's logits were ready. For the last ``--shown`` decode steps it
prints the chunks in time order, relative to the step's start: which server's proxy, which
direction, how many bytes, when it arrived and when it was written (its lateness past ``D``). With D
much larger than the compute, each hop stands apart: the floor's hops (client to server 1, server to
server, last server to client) and anything else that lies on the critical path show as gaps of D.
Then one line per step: its time against ``(servers + 1) x D`` and the proxies' mean lateness.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from benchmarks.harness import SERVER_ARGS, Context

SERVERS = 3
PROMPT_TOKENS = 16


class TokenMarks(LogitsProcessor):
    """Records ``time.monotonic()`` as each new token's logits are ready (the end of its step)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.marks.append(time.monotonic())
        return scores


def run(delay_ms: float, tokens: int, shown: int, push: bool, quick: bool) -> None:
    from petals import AutoDistributedModelForCausalLM
    from petals.testing.delay_proxy import start_server_behind_proxy
    from petals.testing.swarm import LOOPBACK_CLIENT, start_dht

    with tempfile.TemporaryDirectory(prefix="petals-bench-") as workdir, contextlib.ExitStack() as stack:
        ctx = Context(quick, Path(workdir))
        path = ctx.model_path("tiny-llama")
        num_blocks = ctx.num_blocks("tiny-llama")
        bounds = [round(i * num_blocks / SERVERS) for i in range(SERVERS + 1)]
        dht = stack.enter_context(start_dht())
        proxies = []
        for start, end in itertools.pairwise(bounds):
            args = ("--block_indices", f"{start}:{end}", "--torch_dtype", "float32", *SERVER_ARGS)
            _, proxy = stack.enter_context(
                start_server_behind_proxy(path, dht.initial_peers, *args, delay_ms=delay_ms)
            )
            proxies.append(proxy)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, use_server_to_server=push, **LOOPBACK_CLIENT
        )
        stack.callback(model.close)
        prompt = torch.randint(
            3, model.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
        )

        def generate(new_tokens: int, processors: LogitsProcessorList | None = None) -> None:
            with torch.no_grad():
                model.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    logits_processor=processors,
                )

        generate(4)  # warm-up: connections between all peers exist before the recorded run
        time.sleep(1.0)
        events = {f"server {index + 1}": [] for index in range(len(proxies))}
        for proxy, recorded in zip(proxies, events.values(), strict=True):
            proxy.events = recorded
        marks = TokenMarks()
        generate(tokens, LogitsProcessorList([marks]))
        for proxy in proxies:
            proxy.events = None

    delay = delay_ms / 1000
    floor = (SERVERS + 1) * delay if push else 2 * SERVERS * delay
    steps = list(itertools.pairwise(marks.marks))  # decode steps: from one token's logits to the next's
    print(
        f"{len(steps)} decode steps, D = {delay_ms:g} ms, push {'on' if push else 'off'}: floor {floor * 1e3:.0f} ms"
    )
    for number, (start, end) in enumerate(steps, start=1):
        inside = sorted(
            (event.arrived, server, event)
            for server, recorded in events.items()
            for event in recorded
            if start <= event.arrived < end
        )
        late = [event.sent - event.due for _, _, event in inside]
        print(
            f"step {number}: {(end - start) * 1e3:.1f} ms = floor + {(end - start - floor) * 1e3:.1f} ms; "
            f"{len(inside)} chunks, lateness mean {statistics.fmean(late) * 1e3 if late else 0:.2f} ms, "
            f"max {max(late) * 1e3 if late else 0:.2f} ms"
        )
        if number > len(steps) - shown:
            for arrived, server, event in inside:
                arrow = (
                    f"client/peer -> {server}"
                    if event.direction == "to server"
                    else f"{server} -> client/peer"
                )
                print(
                    f"    +{(arrived - start) * 1e3:7.1f} ms  {arrow:26} {event.size:6d} B  "
                    f"written +{(event.sent - start) * 1e3:7.1f} ms (late {(event.sent - event.due) * 1e3:.2f})"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay_ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--shown", type=int, default=3, help="decode steps printed chunk by chunk")
    parser.add_argument("--no_push", action="store_true", help="the client sends every step itself")
    parser.add_argument("--quick", action="store_true", help="a very small model")
    args = parser.parse_args()
    run(args.delay_ms, args.tokens, args.shown, not args.no_push, args.quick)


if __name__ == "__main__":
    main()
