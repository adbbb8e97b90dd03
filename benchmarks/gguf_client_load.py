"""How long a user waits for a client of a GGUF model: its config, its local weights and its tokenizer.

Each run is a fresh process that loads what ``AutoDistributedModelForCausalLM.from_pretrained`` and the
commands load from a demo model's prepared folder (``petals.demo_model``: the GGUF file and the tokenizer
saved from it), timed piece by piece: the config (``AutoDistributedConfig``, from the file's metadata), the
weights (the client model built as ``from_pretrained`` builds it, with the embeddings, norms and head
read from the file; given a stand-in for the network, since it joins no swarm here) and the tokenizer
(``load_tokenizer``, as ``petals generate``, ``chat`` and ``demo`` load it). Imports are timed apart:
they are the same for every format.

"old" is the same process with what petals did before: gguf's own reader (every element of a metadata
array read on its own through the memory map), transformers reading each metadata value through its own
``_gguf_parse_value``, and the tokenizer saved without its added tokens in ``tokenizer_config.json``.
Best of ``--repeats`` runs of each, taking turns.

    python benchmarks/gguf_client_load.py [gemma3|smollm2 ...] [--repeats N] [--cache_dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIECES = ("config", "weights", "tokenizer")
CHILD = "--child"


def load_client(folder: str, old: bool) -> dict[str, float]:
    """Seconds per piece of a client's load of ``folder`` in this (fresh) process."""
    started = time.perf_counter()
    import torch  # noqa: F401

    from petals.auto import AutoDistributedConfig
    from petals.cli.model_files import load_tokenizer
    from petals.client.model import AutoDistributedModelForCausalLM, distributed_class

    if old:
        use_gguf_as_before()
    seconds = {"imports": time.perf_counter() - started}
    started = time.perf_counter()
    config = AutoDistributedConfig.from_pretrained(folder)
    seconds["config"] = time.perf_counter() - started
    started = time.perf_counter()
    model_class = distributed_class(config, AutoDistributedModelForCausalLM)
    model = model_class.from_pretrained(folder, config=config, network=object())  # no swarm to join
    seconds["weights"] = time.perf_counter() - started
    assert not any(parameter.is_meta for parameter in model.parameters())
    started = time.perf_counter()
    tokenizer = load_tokenizer(folder)
    seconds["tokenizer"] = time.perf_counter() - started
    assert len(tokenizer) >= config.vocab_size * 0.99
    return seconds


def use_gguf_as_before() -> None:
    """gguf's own reader, and transformers' own reading of each metadata value."""
    from gguf.gguf_reader import GGUFReader

    import petals.patches

    petals.patches.gguf_reader = GGUFReader
    petals.patches._read_gguf_values_sooner = lambda: lambda: None


def folder_as_before(folder: Path, into: Path) -> Path:
    """``folder`` with its tokenizer saved as before: no added tokens in ``tokenizer_config.json``."""
    for path in folder.iterdir():
        if path.is_file():
            (into / path.name).symlink_to(path.resolve())
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("added_tokens_decoder", None)
    (into / "tokenizer_config.json").unlink()
    (into / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return into


def run_fresh(folder: Path, old: bool) -> dict[str, float]:
    code = [sys.executable, __file__, CHILD, str(folder)] + (["--old"] if old else [])
    done = subprocess.run(
        code, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(folder: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Best seconds per piece, and of the whole (the best run's), old and new."""
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        before = folder_as_before(folder, Path(scratch))
        for _ in range(repeats):
            runs["old"].append(run_fresh(before, old=True))
            runs["new"].append(run_fresh(folder, old=False))
    best = {}
    for name, results in runs.items():
        best[name] = {piece: min(result[piece] for result in results) for piece in ("imports", *PIECES)}
        best[name]["total"] = min(sum(result[piece] for piece in PIECES) for result in results)
    return best


def main() -> None:
    from petals.demo_model import DEMO_MODELS, demo_packages_missing, prepare_demo_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["gemma3"], choices=sorted(DEMO_MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache_dir", default=None, help="where the demo models are prepared")
    args = parser.parse_args()
    for key in args.models:
        demo = DEMO_MODELS[key]
        if demo_packages_missing(demo):
            print(f"{demo.name}: skipped ({demo_packages_missing(demo)})")
            continue
        best = measure(prepare_demo_model(args.cache_dir, demo), args.repeats)
        print(f"{demo.name}: client load, best of {args.repeats} fresh processes each (s)")
        print(f"  {'':8} {'config':>8} {'weights':>8} {'tokenizer':>9} {'total':>7}   (imports)")
        for name in ("old", "new"):
            row = best[name]
            print(
                f"  {name:8} {row['config']:8.2f} {row['weights']:8.2f} {row['tokenizer']:9.2f} "
                f"{row['total']:7.2f}   ({row['imports']:.2f})"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        print(json.dumps(load_client(sys.argv[2], old="--old" in sys.argv)))
    else:
        main()
