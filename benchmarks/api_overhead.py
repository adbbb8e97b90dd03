"""(g) The HTTP API's own overhead: a streamed chat completion vs the same generation in Python.

    python -m benchmarks.api_overhead [--quick]

SmolLM2-135M-Instruct on 3 servers x 10 blocks (the swarm of ``latency_smollm2``). A real
``petals api`` process streams a greedy chat completion (server-sent events, read to ``[DONE]``)
to an HTTP client here; the baseline is ``generate`` of the same prompt tokens and the same
number of new tokens with ``AutoDistributedModelForCausalLM`` in this process, taking turns.
Ratio = API seconds per token / Python client seconds per token (both include the prefill).
With ``--quick``: a 4-block random Llama with SmolLM2's tokenizer, one server, 4 tokens.
"""

from __future__ import annotations

import contextlib
import json
import sys

import httpx2
import torch
from transformers import AutoTokenizer

from benchmarks.harness import Check, Context, Result, Swarm, against_local, main

GOAL = 1.1
QUESTION = "Write a long story about a lighthouse keeper and a storm."


def api_overhead(ctx: Context) -> Result:
    new_tokens, repeats = ctx.pick((64, 5), (4, 1))
    with contextlib.ExitStack() as stack:
        swarm = _chat_swarm(ctx, stack)
        from petals.testing.swarm import start_api

        api = stack.enter_context(start_api(swarm.model_path, swarm.initial_peers))
        http = stack.enter_context(httpx2.Client(base_url=api.url, timeout=300))
        model_id = http.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": new_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        generated = _stream(http, body)  # the end of sequence may come first: the baseline matches it
        client = swarm.client()
        tokenizer = AutoTokenizer.from_pretrained(swarm.model_path)
        prompt = tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]

        def python_client() -> None:
            with torch.no_grad():
                client.generate(prompt, max_new_tokens=generated, do_sample=False)

        def streamed_chat() -> None:
            assert _stream(http, body) == generated

        # against_local runs both at two torch thread counts and keeps the better of each
        samples = against_local(python_client, streamed_chat, repeats)
    per_token = {
        name: {key: value / generated for key, value in result.items() if key in ("best", "median")}
        for name, result in samples.items()
    }
    ratio = per_token["swarm"]["best"] / per_token["local"]["best"]
    return Result(
        item="i",
        title="per-token latency of a streamed chat completion through petals api (SmolLM2, 3 servers)",
        ratio=ratio,
        baseline="the same generation with the Python client, same swarm",
        checks=[Check("API / Python client seconds per token", ratio, GOAL, "<=")],
        measurements={
            "seconds_per_token": {"api": per_token["swarm"], "python client": per_token["local"]},
            "seconds_per_run": samples,
        },
        settings={"model": "smollm2", "servers": 3, "new_tokens": generated, "repeats": repeats},
    )


def _stream(http: httpx2.Client, body: dict) -> int:
    """Send the request, read every event to ``[DONE]``; the number of tokens generated."""
    usage = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage["completion_tokens"]


def _chat_swarm(ctx: Context, stack: contextlib.ExitStack) -> Swarm:
    """SmolLM2's swarm; with --quick, a tiny random model over its tokenizer (the API needs one), on a
    swarm of its own (the context's quick swarm stays up for the next benchmarks)."""
    if not ctx.quick:
        return ctx.swarm("smollm2", servers=3)
    from benchmarks.chat_model import save_tiny_chat_llama
    from petals.testing.swarm import running_swarm

    path = save_tiny_chat_llama(ctx.workdir / "quick-chat-llama")
    dht, servers = stack.enter_context(running_swarm(path, "0:4"))
    swarm = Swarm(path, dht.initial_peers, servers)
    stack.callback(swarm.close_clients)
    return swarm


BENCHMARKS = {"api_overhead": api_overhead}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
