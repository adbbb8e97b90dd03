"""Per-token generation latency through a 2-server local swarm vs the same model run locally.

    python benchmarks/client_latency.py [--new_tokens 64] [--repeats 3]

A tiny random Llama (hidden 256, 8 layers, 8 query / 4 key-value heads, float32) is saved in a
temporary directory and served by two ``petals serve`` processes (blocks 0:4 and 4:8) on 127.0.0.1.
Greedy ``generate`` runs with transformers locally and with ``AutoDistributedModelForCausalLM``;
the best of ``--repeats`` runs of each is reported as seconds per new token, and their ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import petals
from petals.server.server import READY_MESSAGE
from petals.testing.swarm import start_dht, start_server

BENCH_LLAMA = LlamaConfig(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=512,
    vocab_size=32000,
)
LOOPBACK_CLIENT = dict(
    host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False
)


def seconds_per_token(model, input_ids: torch.Tensor, new_tokens: int, repeats: int) -> float:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(input_ids, **kwargs)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids, **kwargs)
        best = min(best, time.perf_counter() - started)
    return best / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    input_ids = torch.randint(3, BENCH_LLAMA.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench-llama"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(BENCH_LLAMA, dtype=torch.float32).save_pretrained(path)
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        local_latency = seconds_per_token(local, input_ids, args.new_tokens, args.repeats)

        server_args = ("--torch_dtype", "float32", "--throughput", "1")
        with (
            start_dht() as dht,
            start_server(
                path, dht.initial_peers, "--block_indices", "0:4", *server_args, wait_ready=False, timeout=120
            ) as first,
            start_server(
                path, dht.initial_peers, "--block_indices", "4:8", *server_args, wait_ready=False, timeout=120
            ) as second,
        ):
            for server in (first, second):
                server.wait_for_log(READY_MESSAGE, timeout=120)
            remote = petals.AutoDistributedModelForCausalLM.from_pretrained(
                path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
            remote_latency = seconds_per_token(remote, input_ids, args.new_tokens, args.repeats)
            remote.remote_blocks.network.close()

    print(f"local transformers: {local_latency * 1000:.2f} ms/token")
    print(f"2-server swarm:     {remote_latency * 1000:.2f} ms/token")
    print(f"ratio swarm/local:  {remote_latency / local_latency:.2f}x (Petals 2.2 measured 5.37x)")


if __name__ == "__main__":
    main()
