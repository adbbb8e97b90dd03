"""(h) Per-token latency over a wide-area network, with and without server-to-server push.

    python -m benchmarks.wan_latency [--quick]

Three servers hold a third of the tiny Llama's blocks each; every one is reached only through a
``DelayProxy`` that holds each chunk ``DELAY_MS`` in each direction (the server listens on a private
port and announces the proxy's). Greedy generation of 16 tokens (the prefill included) after a
16-token prompt, with push on and off, taking turns with plain transformers in this process.
The network floor of one token is ``(servers + 1) x D`` with push (client, server to server, back)
and ``2 x servers x D`` without (each server answers the client, which sends the next one).
Goals: push on within 5 % of its floor plus the local compute, and >= 1.3x faster than push off.

Where the rest goes, measured in the same run: the delay proxy's own cost (the same proxied swarm
with D = 0 against a second, identical swarm on its own DHT that clients reach directly, taking
turns), what is left at D = 0 (direct push on - local), and what appears only with the delay
(push on at D - push on through proxies at D = 0 - the floor). One more push-on run at D, traced
(servers started with ``PETALS_TRACE=1``), prints the mean decode step as the client and each server
measured it. None of these is subtracted from the headline ratio.
"""

from __future__ import annotations

import contextlib
import itertools
import sys

import torch

from benchmarks.generation_latency import describe_breakdown, traced_decode_step
from benchmarks.harness import (
    SERVER_ARGS,
    TRACING_SERVERS,
    Check,
    Context,
    Result,
    _with_threads,
    interleaved,
    main,
    summary,
)

DELAY_MS = 20.0
SERVERS = 3
PROMPT_TOKENS = 16


def wan_latency(ctx: Context) -> Result:
    from petals import AutoDistributedModelForCausalLM
    from petals.server.server import READY_MESSAGE
    from petals.testing.delay_proxy import start_server_behind_proxy
    from petals.testing.swarm import LOOPBACK_CLIENT, start_dht, start_server

    ctx.close_swarm()
    tokens, repeats = ctx.pick((16, 3), (4, 1))
    new_tokens = tokens - 1  # the prefill computes the first token
    path = ctx.model_path("tiny-llama")
    num_blocks = ctx.num_blocks("tiny-llama")
    bounds = [round(i * num_blocks / SERVERS) for i in range(SERVERS + 1)]
    local = ctx.local_model("tiny-llama")
    prompt = torch.randint(
        3, local.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    options = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=local.config.eos_token_id,
    )

    def generate(model) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)

    with contextlib.ExitStack() as stack:
        dht, direct_dht = stack.enter_context(start_dht()), stack.enter_context(start_dht())
        proxies, servers = [], []
        together = dict(env=TRACING_SERVERS, wait_ready=False, wait_joined=False)  # all load at once
        for start, end in itertools.pairwise(bounds):
            args = ("--block_indices", f"{start}:{end}", "--torch_dtype", "float32", *SERVER_ARGS)
            server, proxy = stack.enter_context(
                start_server_behind_proxy(path, dht.initial_peers, *args, delay_ms=DELAY_MS, **together)
            )
            proxies.append(proxy)
            servers += [
                server,
                stack.enter_context(start_server(path, direct_dht.initial_peers, *args, **together)),
            ]
        for server in servers:
            server.wait_for_log(READY_MESSAGE, timeout=180)
        push_on = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        stack.callback(push_on.close)
        direct = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=direct_dht.initial_peers, **LOOPBACK_CLIENT
        )
        stack.callback(direct.close)
        push_off = AutoDistributedModelForCausalLM.from_pretrained(
            path,
            initial_peers=dht.initial_peers,
            network=push_on.remote_blocks.network,
            use_server_to_server=False,
            **LOOPBACK_CLIENT,
        )
        expected = generate(local)
        assert torch.equal(generate(push_on), expected) and torch.equal(generate(push_off), expected)
        local_runs = {
            f"local, {count} threads": _with_threads(lambda: generate(local), count)
            for count in {1, torch.get_num_threads()}
        }
        lateness = ProxyLateness(proxies)
        runs = {
            **local_runs,
            "push on": lateness.counting(lambda: generate(push_on)),
            "push off": lambda: generate(push_off),
        }
        samples = interleaved(runs, repeats)
        breakdown = traced_decode_step(lambda: generate(push_on))
        assert torch.equal(generate(direct), expected)
        for proxy in proxies:
            proxy.delay_ms = 0.0
        runs = {
            "push on, proxies at D = 0": lambda: generate(push_on),
            "push on, direct": lambda: generate(direct),
        }
        samples.update(interleaved(runs, repeats))
    per_token = {name: summary([value / tokens for value in values]) for name, values in samples.items()}
    best = {name: result["best"] for name, result in per_token.items()}
    best["local"] = min(best.pop(name) for name in local_runs)  # credited with its better thread count
    delay = DELAY_MS / 1000
    floor_on, floor_off = (SERVERS + 1) * delay, 2 * SERVERS * delay
    vs_floor = best["push on"] / (floor_on + best["local"])
    speedup = best["push off"] / best["push on"]
    proxy_cost = best["push on, proxies at D = 0"] - best["push on, direct"]
    own_at_zero = best["push on, direct"] - best["local"]
    with_delay = best["push on"] - floor_on - best["push on, proxies at D = 0"]
    late_per_chunk = lateness.seconds / max(lateness.chunks, 1)
    late_on_path = (SERVERS + 1) * late_per_chunk  # one message per hop of the floor
    return Result(
        item="h",
        title=f"per-token latency, {SERVERS} servers each behind a {DELAY_MS:g} ms proxy (tiny-llama)",
        ratio=vs_floor,
        baseline="network floor with push + transformers' own per-token time",
        checks=[
            Check("push on / (floor + local compute)", vs_floor, 1.05, "<="),
            Check("push off / push on seconds per token", speedup, 1.3, ">="),
        ],
        measurements={
            "seconds_per_token": per_token,
            "floor_seconds": {"push on": floor_on, "push off": floor_off},
            "push_on_over_floor_plus_local_seconds": {
                "proxies at D = 0 - direct (the proxy's own cost)": proxy_cost,
                "direct - local (ours at no delay)": own_at_zero,
                "at D - floor - proxies at D = 0 (only with the delay)": with_delay,
            },
            "traced_decode_step_seconds": breakdown,
            "proxy_lateness": {
                "chunks_per_token": lateness.chunks / max(lateness.runs * tokens, 1),
                "mean_seconds_per_chunk": late_per_chunk,
                "on_the_floor_path_seconds_per_token": late_on_path,
            },
        },
        settings={"servers": SERVERS, "delay_ms": DELAY_MS, "tokens": tokens, "repeats": repeats},
        notes=[
            f"per token (best of {repeats}, {tokens} tokens including the prefill): push on {best['push on'] * 1e3:.1f} ms, "
            f"push off {best['push off'] * 1e3:.1f} ms, local transformers {best['local'] * 1e3:.1f} ms",
            f"network floor: {floor_on * 1e3:.0f} ms with push ((servers + 1) x D), "
            f"{floor_off * 1e3:.0f} ms without (2 x servers x D)",
            f"push on - (floor + local): {(best['push on'] - floor_on - best['local']) * 1e3:.1f} ms; "
            f"push off - (floor + local): {(best['push off'] - floor_off - best['local']) * 1e3:.1f} ms",
            f"push on - (floor + local) = {proxy_cost * 1e3:.1f} ms the proxy's own cost (proxies at D = 0 "
            f"{best['push on, proxies at D = 0'] * 1e3:.1f} ms - direct {best['push on, direct'] * 1e3:.1f} ms) "
            f"+ {own_at_zero * 1e3:.1f} ms ours at no delay (direct - local) "
            f"+ {with_delay * 1e3:.1f} ms only with the delay (at D - floor - proxies at D = 0)",
            f"the proxies' own lateness at D (push on runs): {late_per_chunk * 1e3:.2f} ms per chunk past its due time "
            f"({lateness.chunks / max(lateness.runs * tokens, 1):.1f} chunks per token), so about "
            f"{late_on_path * 1e3:.1f} ms per token on the floor's {SERVERS + 1} hops (part of 'only with the delay')",
            "traced decode step at D, push on (mean ms, measured in the client and server processes):",
            *describe_breakdown(breakdown),
        ],
    )


class ProxyLateness:
    """Sums the proxies' lateness (``DelayProxy.late_seconds``) and chunks over the runs it wraps."""

    def __init__(self, proxies: list) -> None:
        self.proxies = proxies
        self.seconds, self.chunks, self.runs = 0.0, 0, 0

    def counting(self, run):
        def counted() -> object:
            seconds = sum(proxy.late_seconds for proxy in self.proxies)
            chunks = sum(proxy.chunks_sent for proxy in self.proxies)
            result = run()
            self.seconds += sum(proxy.late_seconds for proxy in self.proxies) - seconds
            self.chunks += sum(proxy.chunks_sent for proxy in self.proxies) - chunks
            self.runs += 1
            return result

        return counted


BENCHMARKS = {"wan_latency": wan_latency}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
