"""How fast a ``petals serve`` process becomes ONLINE, how many processes it runs, how much memory.

    python benchmarks/server_start.py

Starts a local bootstrap peer and one server hosting all blocks of a tiny random Llama (saved in a
temporary directory), all on 127.0.0.1 with NAT/relay features off, and prints:
seconds from process start to ONLINE, the server's processes (python + p2pd), and their PSS.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from petals.testing.swarm import start_dht, start_server

TINY_LLAMA = LlamaConfig(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(tmp) / "tiny-llama"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(TINY_LLAMA).save_pretrained(model_path)
        with start_dht() as dht:
            with start_server(
                model_path, dht.initial_peers, "--block_indices", "0:4", "--throughput", "1"
            ) as server:
                root = psutil.Process(server.pid)
                processes = [root, *root.children(recursive=True)]
                pss = {process.name(): process.memory_full_info().pss for process in processes}
                print(f"start → ONLINE: {server.ready_seconds:.2f} s")
                print(f"processes: {len(processes)} ({', '.join(pss)})")
                for name, value in pss.items():
                    print(f"PSS {name}: {value / 2**20:.1f} MiB")
                print(f"PSS total: {sum(pss.values()) / 2**20:.1f} MiB")
    sys.exit(0)


if __name__ == "__main__":
    main()
