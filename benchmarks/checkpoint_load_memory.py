"""Peak memory while a server loads one block from a quantized checkpoint, against the dense block.

    python -m benchmarks.checkpoint_load_memory [--quick]

For MXFP4 (a GPT-OSS-shaped model: 32 experts, hidden 1024) and GPTQ 4-bit (a Llama-shaped model,
hidden 2048), a two-layer checkpoint is written in the published layout (random packed bytes of the
real names, shapes and dtypes: memory does not depend on the values) beside a dense checkpoint of
the same model in the serving dtype. A fresh process imports everything, resets its peak RSS
(``/proc/self/clear_refs``), loads block 1 with ``petals.loading.load_block`` and reads the peak
(``VmHWM``, pages mapped from the checkpoint included). Printed: the peak growth over the dense
block's bytes, for the quantized checkpoint and for the dense one (what plain weights cost).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig

MIB = 2**20
MEASURE = """
import sys, torch
from petals.auto import AutoDistributedConfig
from petals.loading import Checkpoint, load_block
path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
config, checkpoint = AutoDistributedConfig.from_pretrained(path), Checkpoint.open(path)
load_block(path, 0, dtype, config=config, checkpoint=checkpoint)  # imports and first-call costs
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
import gc; gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS:")
block = load_block(path, 1, dtype, config=config, checkpoint=checkpoint)
peak = status("VmHWM:")
dense = sum(t.numel() * t.element_size() for t in block.state_dict().values())
print(peak - base, dense)
"""


def shapes(config) -> dict[str, tuple[torch.Size, torch.dtype]]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {name: (tensor.shape, tensor.dtype) for name, tensor in model.state_dict().items()}


def write(path: Path, tensors: dict[str, torch.Tensor], config, quantization_config: dict | None) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config_json = config.to_dict()
    config_json["dtype"] = "bfloat16"
    if quantization_config is not None:
        config_json["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config_json))
    return path


def random_dense(name_shapes) -> dict[str, torch.Tensor]:
    return {name: torch.randn(shape).to(dtype) * 0.02 for name, (shape, dtype) in name_shapes.items()}


def mxfp4_pair(root: Path, quick: bool) -> tuple[Path, Path]:
    config = GptOssConfig(
        hidden_size=512 if quick else 1024,
        intermediate_size=512 if quick else 1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
        num_local_experts=32,
        num_experts_per_tok=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    dense = random_dense(shapes(config))
    packed = {}
    for name, tensor in dense.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, ins, outs = tensor.shape
            packed[f"{name}_blocks"] = torch.randint(
                0, 256, (experts, outs, ins // 32, 16), dtype=torch.uint8
            )
            packed[f"{name}_scales"] = torch.randint(118, 124, (experts, outs, ins // 32), dtype=torch.uint8)
        else:
            packed[name] = tensor
    quantized = write(root / "mxfp4", packed, config, {"quant_method": "mxfp4"})
    return quantized, write(root / "mxfp4-dense", dense, config, None)


def gptq_pair(root: Path, quick: bool) -> tuple[Path, Path]:
    hidden = 1024 if quick else 2048
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1000,
    )
    dense = random_dense(shapes(config))
    packed, group = {}, 128
    for name, tensor in dense.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            prefix, (outs, ins) = name.removesuffix("weight"), tensor.shape
            packed[prefix + "qweight"] = torch.randint(
                -(2**31), 2**31 - 1, (ins // 8, outs), dtype=torch.int32
            )
            packed[prefix + "qzeros"] = torch.full((ins // group, outs // 8), 0x77777777, dtype=torch.int32)
            packed[prefix + "scales"] = (torch.rand(ins // group, outs) * 1e-3).to(torch.float16)
            packed[prefix + "g_idx"] = (torch.arange(ins) // group).to(torch.int32)
        else:
            packed[name] = tensor
    quantization_config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": True,
    }
    quantized = write(root / "gptq", packed, config, quantization_config)
    return quantized, write(root / "gptq-dense", dense, config, None)


def measure(path: Path, dtype: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), dtype], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[-2]), int(out[-1])


def main() -> None:
    quick = "--quick" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in (("mxfp4", mxfp4_pair), ("gptq", gptq_pair)):
            quantized, dense = build(Path(tmp), quick)
            for dtype in ("bfloat16", "float32"):
                peak, block = measure(quantized, dtype)
                dense_peak, _ = measure(dense, dtype)
                print(
                    f"{name:5s} -> {dtype:8s}: dense block {block / MIB:7.1f} MiB; peak RSS growth while loading "
                    f"{peak / MIB:7.1f} MiB ({peak / block:.2f}x the block) from the {name} checkpoint, "
                    f"{dense_peak / MIB:7.1f} MiB ({dense_peak / block:.2f}x) from the dense one"
                )


if __name__ == "__main__":
    main()
