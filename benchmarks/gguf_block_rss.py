"""Peak memory while a server loads a block range from a GGUF file, against the dense blocks' size.

Each measurement runs in a fresh process: open the file (config, name map), reset the kernel's peak-RSS
mark (``/proc/self/clear_refs``), load the blocks as ``petals serve`` does (``load_block`` per index, the
file's tensors read by name, quantized matrices kept packed), then read the peak (``VmHWM``). Beside it,
plain transformers loading the whole file dequantized (float32), peak over its own baseline the same way.

    python benchmarks/gguf_block_rss.py [smollm2 0:10] [gemma3 0:6] ...
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, torch
from pathlib import Path

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def reset_peak():
    open("/proc/self/clear_refs", "w").write("5")

mode, path, start, end = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if mode == "petals":
    from petals.auto import AutoDistributedConfig
    from petals.loading import load_block, open_checkpoint
    config = AutoDistributedConfig.from_pretrained(path)
    checkpoint = open_checkpoint(path)
    before = status("VmRSS:"); reset_peak()
    blocks = [load_block(path, i, torch.float32, config=config, checkpoint=checkpoint) for i in range(start, end)]
    dense = sum(t.numel() * t.element_size() for b in blocks for t in b.state_dict().values())
else:
    from transformers import AutoModelForCausalLM, GgufConfig
    import transformers  # imported before the baseline, as petals' side imports it before its own
    before = status("VmRSS:"); reset_peak()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True))
    dense = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"peak_over_baseline": status("VmHWM:") - before, "dense": dense}))
"""


def measure(mode: str, path: str, start: int, end: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, path, str(start), str(end)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    from petals.demo_model import DEMO_MODELS, demo_packages_missing, prepare_demo_model

    pairs = list(zip(argv[::2], argv[1::2], strict=True)) or [("smollm2", "0:10"), ("gemma3", "0:6")]
    mib = 2**20
    for key, blocks in pairs:
        demo = DEMO_MODELS[key]
        if demo_packages_missing(demo):
            print(f"{demo.name}: skipped ({demo_packages_missing(demo)})")
            continue
        path = str(prepare_demo_model(None, demo) / demo.gguf_file)
        start, end = (int(part) for part in blocks.split(":"))
        ours = measure("petals", path, start, end)
        whole = measure("transformers", path, 0, 0)
        print(
            f"{demo.name} blocks {blocks}: peak RSS while loading {ours['peak_over_baseline'] / mib:.1f} MiB "
            f"over the opened file, dense float32 blocks {ours['dense'] / mib:.1f} MiB "
            f"(ratio {ours['peak_over_baseline'] / ours['dense']:.2f}); transformers loading the whole file: "
            f"{whole['peak_over_baseline'] / mib:.1f} MiB peak for {whole['dense'] / mib:.1f} MiB dense "
            f"(ratio {whole['peak_over_baseline'] / whole['dense']:.2f})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
