"""Memory of ``petals serve`` measured from outside: the same weights served packed and dense, side by side.

    python -m benchmarks.packed_memory [--quick] [--only fp8 nf4 gguf] [--results DIR]

Three pairs of servers, each pair in one swarm at the same time, hosting the same blocks in bfloat16:

- ``fp8``: an FP8 block-wise checkpoint (128x128 ``weight_scale_inv``) of a wide Llama (hidden 1024,
  8 blocks, 90M block parameters), served packed, vs its dense bfloat16 copy (the FP8 weights
  dequantized);
- ``nf4``: a Qwen3-MoE (16 experts, 8 blocks) served with ``--quant_type nf4`` vs served as it is;
- ``gguf``: the demo's GGUF file (SmolLM2-135M-Instruct, Q4_1, blocks 0:30), served packed, vs a dense
  bfloat16 copy of it (transformers' own dequantized load, saved as safetensors).

Each server has its own ``--dht_prefix``. Once both are ONLINE (and have collected their startup garbage,
``malloc_trim`` included), each ``petals serve`` process (the python process, not its p2pd) is read from
outside: RSS, PSS, USS, and ``RssAnon``/``RssFile`` from ``/proc/PID/status``; beside them the weights it
reports holding (the log's ``Weight memory``, what ``petals.convert.block_weight_bytes`` counts) and what
its blocks take stored in the checkpoint. Then a client generates through each server alone and its
memory is read again (a packed weight dequantizes per forward: its temporaries could stay in the heap).
The difference of RSS between the two servers should be the difference of their weights;
``resident / stored`` should be at most 1.10 for a packed format. Results:
``benchmarks/results/packed_memory.json``.

What the weights did not explain when this was written (2 vCPU, glibc 2.36): ``nf4``, the import of
bitsandbytes (its default backend wraps functions in ``torch.compile`` at import: torch._dynamo, inductor,
sympy, networkx), about 115 MiB whatever the model's size. ``gguf`` left 235 MiB unexplained while a
server kept its GGUF reader (the parsed metadata, a tokenizer's vocabulary as numpy views, and the file's
memory map with the pages loading read) for its whole life; since a server releases it once its blocks
are loaded (``petals.formats.gguf.release_readers``), 15 MiB. ``--only`` rewrites the named pairs'
results and keeps the others'.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3MoeConfig

from benchmarks.harness import RESULTS_DIR, machine_info

MIB = 2**20
GOAL_RESIDENT_OVER_STORED = 1.10
FP8_BLOCK = 128
E4M3_MAX = 448.0
# every server: no throughput measurement at start (it would run forward passes), the same cache
SERVER_ARGS = ("--throughput", "1", "--attn_cache_tokens", "1024", "--torch_dtype", "bfloat16")
WEIGHT_MEMORY = re.compile(r"Weight memory: [\d.]+ MiB \((\d+) bytes\)")
SETTLE_SECONDS = 3  # after ONLINE: the startup collection and malloc_trim run just after it


@dataclass(frozen=True)
class Served:
    """One ``petals serve`` of a pair: what it serves, with which options."""

    label: str
    model: Path
    args: tuple[str, ...]


@dataclass(frozen=True)
class Pair:
    name: str
    title: str
    blocks: str
    packed: Served
    dense: Served


# ---- the checkpoints -----------------------------------------------------------------------------


def random_model(config: PretrainedConfig, path: Path) -> Path:
    """A random bfloat16 model of ``config`` saved at ``path`` (memory does not depend on the values)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 codes, float32 weight_scale_inv)`` per 128x128 block, each block's largest magnitude at 448
    (the shapes here are multiples of 128)."""
    rows, cols = weight.shape
    blocks = weight.float().view(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, cols)
    return codes, scale


def fp8_pair(root: Path, quick: bool) -> Pair:
    """A wide Llama's FP8 block-wise checkpoint (every decoder linear) and its dense bfloat16 copy."""
    from petals.auto import AutoDistributedConfig
    from petals.formats import dequantize_tensors

    hidden = 512 if quick else 1024  # key and value rows: 128 or 256
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4 // FP8_BLOCK * FP8_BLOCK,  # whole blocks: 2816
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1000,
    )
    source = random_model(config, root / "llama-source")
    stored = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            stored[name], stored[f"{name}_scale_inv"] = quantize_fp8(tensor)
        else:
            stored[name] = tensor
    config_json = json.loads((source / "config.json").read_text())
    config_json["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    fp8 = _write(root / "llama-fp8", stored, config_json)
    dense_tensors = dequantize_tensors(AutoDistributedConfig.from_pretrained(fp8), stored, torch.bfloat16)
    del config_json["quantization_config"]
    dense = _write(root / "llama-dense", dense_tensors, config_json)
    blocks = f"0:{config.num_hidden_layers}"
    return Pair(
        "fp8",
        "FP8 block-wise checkpoint served packed vs its dense bfloat16 copy",
        blocks,
        Served("fp8 packed", fp8, ()),
        Served("bf16 dense", dense, ()),
    )


def nf4_pair(root: Path, quick: bool) -> Pair:
    """A Qwen3-MoE with 16 experts, served with ``--quant_type nf4`` and as it is."""
    hidden = 128 if quick else 512
    config = Qwen3MoeConfig(
        hidden_size=hidden,
        intermediate_size=hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        vocab_size=1000,
    )
    model = random_model(config, root / "qwen3-moe")
    blocks = f"0:{config.num_hidden_layers}"
    return Pair(
        "nf4",
        "Qwen3-MoE (16 experts) with --quant_type nf4 vs bfloat16",
        blocks,
        Served("nf4", model, ("--quant_type", "nf4")),
        Served("bf16", model, ("--quant_type", "none")),
    )


def gguf_pair(root: Path, quick: bool) -> Pair:
    """The demo's GGUF file (SmolLM2-135M-Instruct, Q4_1) and a dense bfloat16 copy of it."""
    from petals.demo_model import DEMO, prepare_demo_model
    from petals.formats.gguf import local_model

    gguf = prepare_demo_model() / DEMO.gguf_file
    dense = root / "smollm2-dense"
    local_model(gguf, dtype=torch.bfloat16).save_pretrained(dense)
    return Pair(
        "gguf",
        "the demo's GGUF (SmolLM2, Q4_1) served packed vs a dense bfloat16 copy",
        "0:30",
        Served("gguf packed", gguf, ()),
        Served("bf16 dense", dense, ()),
    )


PAIRS: dict[str, Callable[[Path, bool], Pair]] = {"fp8": fp8_pair, "nf4": nf4_pair, "gguf": gguf_pair}


def _write(path: Path, tensors: dict[str, torch.Tensor], config_json: dict) -> Path:
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_json, indent=2))
    return path


# ---- what the blocks take stored -----------------------------------------------------------------


def stored_block_bytes(model: Path, blocks: range) -> int:
    """Bytes the checkpoint stores for ``blocks`` (every tensor of theirs, scales included): from the
    safetensors headers, or the GGUF file's tensor table."""
    from petals.auto import AutoDistributedConfig
    from petals.formats.gguf import gguf_file, reader

    gguf = gguf_file(model)
    if gguf is not None:
        prefixes = tuple(f"blk.{index}." for index in blocks)
        return sum(int(tensor.n_bytes) for tensor in reader(gguf).tensors if tensor.name.startswith(prefixes))
    prefix = AutoDistributedConfig.from_pretrained(model).block_prefix
    prefixes = tuple(f"{prefix}.{index}." for index in blocks)
    total = 0
    for file in model.glob("*.safetensors"):
        with file.open("rb") as stream:
            (header_size,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(header_size))
        total += sum(
            entry["data_offsets"][1] - entry["data_offsets"][0]
            for key, entry in header.items()
            if key.startswith(prefixes)
        )
    return total


# ---- serving and measuring -----------------------------------------------------------------------


def process_memory(pid: int) -> dict[str, int]:
    """RSS, PSS, USS and the kernel's split of RSS into anonymous and file-backed pages, in bytes."""
    process = psutil.Process(pid)
    full = process.memory_full_info()
    status = {
        line.split(":")[0]: int(line.split()[1]) * 1024
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith(("RssAnon", "RssFile", "RssShmem", "VmHWM"))
    }
    return {"rss": full.rss, "pss": full.pss, "uss": full.uss, **status}


def serve_side_by_side(pair: Pair) -> dict[str, dict[str, Any]]:
    """Both servers of ``pair`` in one swarm, each under its own DHT prefix: each one's memory and weights
    read from outside once ONLINE, and its memory again after a client has generated through it."""
    from petals.server.server import READY_MESSAGE
    from petals.testing.swarm import start_dht, start_server

    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(start_dht())
        servers = {
            served: stack.enter_context(
                start_server(
                    served.model,
                    dht.initial_peers,
                    *("--block_indices", pair.blocks, "--dht_prefix", _prefix(served)),
                    *SERVER_ARGS,
                    *served.args,
                    wait_ready=False,
                    wait_joined=False,
                    timeout=600,
                )
            )
            for served in (pair.packed, pair.dense)
        }
        for server in servers.values():
            server.wait_for_log(READY_MESSAGE, timeout=600)
        time.sleep(SETTLE_SECONDS)
        measured = {
            served.label: {
                **process_memory(server.pid),
                "weights": int(WEIGHT_MEMORY.search(server.log).group(1)),
            }
            for served, server in servers.items()
        }
        for served, server in servers.items():
            generate_through(served, dht.initial_peers)
            measured[served.label]["after_serving"] = process_memory(server.pid)
        return measured


def generate_through(served: Served, initial_peers: list[str]) -> None:
    """A client's greedy generation (a 64-token prompt, 16 new tokens) through ``served``'s server alone."""
    from petals import AutoDistributedModelForCausalLM
    from petals.testing.swarm import LOOPBACK_CLIENT

    model = AutoDistributedModelForCausalLM.from_pretrained(
        served.model, initial_peers=initial_peers, dht_prefix=_prefix(served), **LOOPBACK_CLIENT
    )
    try:
        prompt = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(0))
        model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    finally:
        model.close()


def _prefix(served: Served) -> str:
    return "packed-memory-" + re.sub(r"[^a-z0-9]+", "-", served.label)


def measure_pair(pair: Pair) -> dict[str, Any]:
    start, stop = (int(part) for part in pair.blocks.split(":"))
    measured = serve_side_by_side(pair)
    for served in (pair.packed, pair.dense):
        measured[served.label]["stored"] = stored_block_bytes(served.model, range(start, stop))
    packed, dense = measured[pair.packed.label], measured[pair.dense.label]
    weights = packed["weights"] - dense["weights"]
    serving = packed["after_serving"]["rss"] - dense["after_serving"]["rss"]
    return {
        "title": pair.title,
        "blocks": pair.blocks,
        "servers": measured,
        "weights_difference": weights,
        "rss_difference": packed["rss"] - dense["rss"],
        "pss_difference": packed["pss"] - dense["pss"],
        "beyond_the_weights": packed["rss"] - dense["rss"] - weights,
        "rss_difference_after_serving": serving,
        "beyond_the_weights_after_serving": serving - weights,
        "resident_over_stored": {
            label: server["weights"] / server["stored"] for label, server in measured.items()
        },
    }


# ---- report --------------------------------------------------------------------------------------


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| pair | server | RSS MiB | PSS MiB | RssAnon MiB | RssFile MiB | RSS after serving MiB | weights MiB "
        "| stored MiB | resident / stored |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for label, server in result["servers"].items():
            lines.append(
                f"| {name} | {label} | {server['rss'] / MIB:.1f} | {server['pss'] / MIB:.1f} | "
                f"{server['RssAnon'] / MIB:.1f} | {server['RssFile'] / MIB:.1f} | "
                f"{server['after_serving']['rss'] / MIB:.1f} | {server['weights'] / MIB:.1f} | "
                f"{server['stored'] / MIB:.1f} | {result['resident_over_stored'][label]:.3f}x |"
            )
    lines += [
        "",
        "| pair | weights packed - dense | RSS packed - dense | PSS packed - dense | RSS beyond the weights "
        "| after serving: RSS packed - dense | beyond the weights |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        lines.append(
            f"| {name} | {result['weights_difference'] / MIB:+.1f} MiB | {result['rss_difference'] / MIB:+.1f} MiB "
            f"| {result['pss_difference'] / MIB:+.1f} MiB | {result['beyond_the_weights'] / MIB:+.1f} MiB "
            f"| {result['rss_difference_after_serving'] / MIB:+.1f} MiB "
            f"| {result['beyond_the_weights_after_serving'] / MIB:+.1f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models: a smoke test")
    parser.add_argument("--only", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="petals-packed-memory-") as workdir:
        for name in args.only:
            print(f"== {name}", flush=True)
            root = Path(workdir) / name
            root.mkdir()
            results[name] = measure_pair(PAIRS[name](root, args.quick))
    print(table(results))
    write_results(args.results / "packed_memory.json", results, args.quick)


def write_results(path: Path, results: dict[str, dict[str, Any]], quick: bool) -> None:
    """The pairs measured now, each with its date, in place of their earlier results (``--only`` leaves
    the other pairs' as they were, unless those were measured with another ``--quick``)."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    pairs = earlier.get("pairs", {}) if earlier.get("quick") == quick else {}
    for result in pairs.values():
        result.setdefault("date", earlier.get("date"))
    record = {
        "benchmark": "packed_memory",
        "quick": quick,
        "goal_resident_over_stored": GOAL_RESIDENT_OVER_STORED,
        "pairs": {**pairs, **{name: {**result, "date": now} for name, result in results.items()}},
        "date": now,
        "machine": machine_info(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
