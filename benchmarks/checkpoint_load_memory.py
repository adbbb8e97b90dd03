"""Peak memory while a server loads one block from a quantized checkpoint, against the dense block.

    python -m benchmarks.checkpoint_load_memory [--quick]

For MXFP4 (a GPT-OSS-shaped model: 32 experts, hidden 1024) and for FP8 block-wise (128x128 blocks),
FP8 per-tensor, GPTQ 4-bit and AWQ 4-bit (a Llama-shaped model, hidden 2048), a two-layer checkpoint
is written in the published layout (random packed bytes of the real names, shapes and dtypes: memory
does not depend on the values) beside a dense checkpoint of the same model in the serving dtype. A fresh process imports everything, resets its peak RSS
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
from petals.loading import open_checkpoint
path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
config, checkpoint = AutoDistributedConfig.from_pretrained(path), open_checkpoint(path)
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


def llama_config(quick: bool) -> LlamaConfig:
    hidden = 1024 if quick else 2048
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1000,
    )


GROUP = 128  # GPTQ/AWQ inputs per group, FP8 block rows and columns


def gptq_linear(outs: int, ins: int) -> dict[str, torch.Tensor]:
    return {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (ins // 8, outs), dtype=torch.int32),
        "qzeros": torch.full((ins // GROUP, outs // 8), 0x77777777, dtype=torch.int32),
        "scales": (torch.rand(ins // GROUP, outs) * 1e-3).to(torch.float16),
        "g_idx": (torch.arange(ins) // GROUP).to(torch.int32),
    }


def awq_linear(outs: int, ins: int) -> dict[str, torch.Tensor]:
    return {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (ins, outs // 8), dtype=torch.int32),
        "qzeros": torch.full((ins // GROUP, outs // 8), 0x77777777, dtype=torch.int32),
        "scales": (torch.rand(ins // GROUP, outs) * 1e-3).to(torch.float16),
    }


def fp8_linear(outs: int, ins: int, blocks: bool) -> dict[str, torch.Tensor]:
    grid = (-(-outs // GROUP), -(-ins // GROUP)) if blocks else ()
    return {
        "weight": torch.randn(outs, ins).to(torch.float8_e4m3fn),
        "weight_scale_inv": torch.rand(grid) * 1e-3,
    }


LLAMA_FORMATS = {  # name -> (one linear's stored tensors by suffix, quantization_config)
    "gptq": (gptq_linear, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False}),
    "awq": (awq_linear, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"}),
    "fp8 blocks": (
        lambda outs, ins: fp8_linear(outs, ins, blocks=True),
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [GROUP, GROUP]},
    ),
    "fp8 tensor": (
        lambda outs, ins: fp8_linear(outs, ins, blocks=False),
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None},
    ),
}


def llama_checkpoints(root: Path, quick: bool, formats: list[str]) -> dict[str, Path]:
    """The dense Llama-shaped checkpoint (``"dense"``) and one per format, its decoder linears packed."""
    config = llama_config(quick)
    dense = random_dense(shapes(config))
    written = {"dense": write(root / "llama-dense", dense, config, None)}
    for name in formats:
        pack, quantization_config = LLAMA_FORMATS[name]
        packed = {}
        for tensor_name, tensor in dense.items():
            if tensor_name.startswith("model.layers.") and tensor_name.endswith("proj.weight"):
                prefix = tensor_name.removesuffix("weight")
                packed.update({prefix + suffix: stored for suffix, stored in pack(*tensor.shape).items()})
            else:
                packed[tensor_name] = tensor
        written[name] = write(root / name.replace(" ", "-"), packed, config, quantization_config)
    return written


def measure(path: Path, dtype: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), dtype], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[-2]), int(out[-1])


def report(name: str, dtype: str, quantized: Path, dense_peak: int) -> None:
    peak, block = measure(quantized, dtype)
    print(
        f"{name:10s} -> {dtype:8s}: dense block {block / MIB:7.1f} MiB; peak RSS growth while loading "
        f"{peak / MIB:7.1f} MiB ({peak / block:.2f}x the block) from the {name} checkpoint, "
        f"{dense_peak / MIB:7.1f} MiB ({dense_peak / block:.2f}x) from the dense one"
    )


def main() -> None:
    quick = "--quick" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        quantized, dense = mxfp4_pair(Path(tmp), quick)
        llama = llama_checkpoints(Path(tmp), quick, list(LLAMA_FORMATS))
        for dtype in ("bfloat16", "float32"):
            report("mxfp4", dtype, quantized, measure(dense, dtype)[0])
            dense_peak, _ = measure(llama["dense"], dtype)
            for name in LLAMA_FORMATS:
                report(name, dtype, llama[name], dense_peak)


if __name__ == "__main__":
    main()
