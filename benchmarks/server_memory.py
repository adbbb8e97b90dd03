"""(e) Processes and memory of a serving ``petals serve`` vs the bytes of the weights it hosts.

    python -m benchmarks.server_memory [--quick]

One server hosts all 30 blocks of SmolLM2-135M-Instruct in float32. After a client has generated
through it, the server's process tree (python + p2pd) is counted and its PSS summed
(``psutil.Process.memory_full_info().pss``: shared pages split fairly between processes), except
that pages mapped from the checkpoint's files count whole (their RSS): other processes mapping the
same file (a client, another server, a local model) would otherwise take a share of the weights'
pages and make the overhead look smaller than it is. The weights are the bytes of the hosted
blocks' tensors in the checkpoint (embeddings and LM head stay with the clients). Ratio = memory /
weights; goals: at most 3 processes, memory <= weights + 250 MiB.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import psutil
import torch

from benchmarks.harness import Check, Context, Result, main

MIB = 2**20
GOAL_PROCESSES = 3
GOAL_OVERHEAD_MIB = 250


def block_weight_bytes(model_path: Path, block_prefix: str) -> int:
    """Bytes of the checkpoint's tensors under ``block_prefix`` (read from safetensors headers only)."""
    total = 0
    for file in model_path.glob("*.safetensors"):
        with file.open("rb") as stream:
            (header_size,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(header_size))
        total += sum(
            entry["data_offsets"][1] - entry["data_offsets"][0]
            for key, entry in header.items()
            if key.startswith(block_prefix + ".")
        )
    return total


def memory_bytes(process: psutil.Process, whole_files: set[str]) -> int:
    """PSS of ``process``, but mappings of ``whole_files`` counted with their RSS (not shared out)."""
    maps = process.memory_maps(grouped=True)
    pss = sum(mapping.pss for mapping in maps)
    return pss + sum(mapping.rss - mapping.pss for mapping in maps if mapping.path in whole_files)


def server_memory(ctx: Context) -> Result:
    from petals import AutoDistributedConfig

    ctx.drop_local_models()  # no local model sharing pages with the server
    swarm = ctx.swarm("smollm2", servers=1)  # stops any other swarm
    client = swarm.client()
    prompt = torch.randint(3, client.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    client.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)  # now it is serving

    server = psutil.Process(swarm.servers[0].pid)
    processes = [server, *server.children(recursive=True)]
    checkpoint = {str(file.resolve()) for file in Path(swarm.model_path).glob("*.safetensors")}
    pss = {f"{process.name()} ({process.pid})": memory_bytes(process, checkpoint) for process in processes}
    total_pss = sum(pss.values())
    config = AutoDistributedConfig.from_pretrained(swarm.model_path)
    weights = block_weight_bytes(swarm.model_path, config.block_prefix)
    overhead_mib = (total_pss - weights) / MIB
    return Result(
        item="e",
        title="serving server: processes and PSS vs hosted weights (smollm2, 30 blocks, fp32)",
        ratio=total_pss / weights,
        baseline="bytes of the hosted blocks' weights",
        checks=[
            Check("server processes", len(processes), GOAL_PROCESSES, "<=", unit="processes"),
            Check("PSS - weights", overhead_mib, GOAL_OVERHEAD_MIB, "<=", unit="MiB"),
        ],
        measurements={
            "processes": len(processes),
            "pss_mib": {name: value / MIB for name, value in pss.items()},
            "total_pss_mib": total_pss / MIB,
            "weights_mib": weights / MIB,
            "overhead_mib": overhead_mib,
        },
        settings={"model": "smollm2", "blocks": f"0:{config.num_hidden_layers}", "dtype": "float32"},
    )


BENCHMARKS = {"server_memory": server_memory}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
