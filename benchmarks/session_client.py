"""One client process of the ``concurrent_sessions`` benchmark (started by it, not by hand).

    python -m benchmarks.session_client MODEL_PATH PEERS_JSON PROMPT_LENGTH NEW_TOKENS DELAY SEED [DEVICE]

Loads the client model, warms its routes and connections up, prints ``ready``; then for every
``go`` line on stdin waits DELAY seconds, generates NEW_TOKENS tokens greedily in a new inference
session and prints ``{"start": ..., "end": ..., "tokens": ...}`` (``time.monotonic``, the same
clock in every process of this machine). An empty line or end of input stops it. DEVICE (``cpu`` unless
given, e.g. ``cuda``) holds the client's embeddings and LM head, in the checkpoint's dtype.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main(
    model_path: str,
    peers: str,
    prompt_length: str,
    new_tokens: str,
    delay: str,
    seed: str,
    device: str = "cpu",
) -> None:
    from petals import AutoDistributedModelForCausalLM
    from petals.testing.swarm import LOOPBACK_CLIENT

    torch.set_num_threads(1)  # eight of these share the machine's cores with the servers
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=json.loads(peers), **LOOPBACK_CLIENT
    ).to(device)
    generator = torch.Generator().manual_seed(int(seed))
    prompt = torch.randint(3, model.config.vocab_size, (1, int(prompt_length)), generator=generator).to(
        device
    )
    tokens = int(new_tokens)
    options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        print("ready", flush=True)
        while sys.stdin.readline().strip() == "go":
            time.sleep(float(delay))
            start = time.monotonic()
            model.generate(prompt, **options)
            print(json.dumps({"start": start, "end": time.monotonic(), "tokens": tokens}), flush=True)
    model.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
