"""A block served packed holds its weights in the bytes its checkpoint stores them in, for every format.

For each safetensors format petals reads (tiny checkpoints written by the formats' tests in each
release's layout), every block loaded as a server loads it, in the checkpoint's own dtype: the bytes it
holds (``block_weight_bytes``: every tensor of its state dict) are at most 1.10x what the checkpoint
stores for that block (its tensors' bytes, scales and zeros included), and at least what the dequantized
block would save a third of. GGUF files: tests/test_gguf.py; the weights of a running server measured
from outside (RSS): benchmarks/packed_memory.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_checkpoint_formats import DEEPSEEK_V3, QWEN3_MOE, save_fp8_checkpoint
from test_checkpoint_formats_int4 import save_int4_checkpoint, save_mxfp4_checkpoint

from conftest import tiny_config
from petals.auto import AutoDistributedConfig
from petals.convert import block_weight_bytes
from petals.loading import load_block, open_checkpoint

MAX_RESIDENT_OVER_STORED = 1.10
CHECKPOINTS: dict[str, Callable[[Path], tuple[Path, Path]]] = {
    "fp8 128x128 blocks (DeepSeek V3)": lambda path: save_fp8_checkpoint(DEEPSEEK_V3, path, [128, 128]),
    "fp8 16x24 blocks, cropped": lambda path: save_fp8_checkpoint(tiny_config("llama"), path, [16, 24]),
    "fp8 per tensor": lambda path: save_fp8_checkpoint(tiny_config("llama"), path, None),
    "fp8 AutoFP8 per channel": lambda path: save_fp8_checkpoint(
        tiny_config("llama"), path, None, layout="autofp8"
    ),
    "fp8 compressed-tensors (Qwen3-MoE)": lambda path: save_fp8_checkpoint(
        QWEN3_MOE, path, None, layout="compressed-tensors"
    ),
    "mxfp4 (gpt-oss)": save_mxfp4_checkpoint,
    "gptq int4": lambda path: save_int4_checkpoint(path, "gptq"),
    "gptq int4 act order": lambda path: save_int4_checkpoint(path, "gptq", desc_act=True, sym=False),
    "gptq int8": lambda path: save_int4_checkpoint(path, "gptq", bits=8),
    "gptq int4 (Qwen3-MoE)": lambda path: save_int4_checkpoint(path, "gptq", config=QWEN3_MOE),
    "awq int4": lambda path: save_int4_checkpoint(path, "awq"),
}


def stored_block_bytes(path: Path, config, index: int) -> int:
    """What the checkpoint stores for block ``index``: its tensors' bytes as read from the files."""
    checkpoint = open_checkpoint(path)
    _, keys = checkpoint.block_keys(config.block_prefix, index)
    return sum(tensor.nbytes for tensor in checkpoint.read(keys).values())


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_packed_block_holds_the_bytes_its_checkpoint_stores(tmp_path, name):
    quantized, _ = CHECKPOINTS[name](tmp_path)
    config = AutoDistributedConfig.from_pretrained(quantized)
    for index in range(config.num_hidden_layers):
        stored = stored_block_bytes(quantized, config, index)
        packed = block_weight_bytes(load_block(quantized, index, config=config))
        dequantized = block_weight_bytes(load_block(quantized, index, config=config, weights="dequantized"))
        print(
            f"{name} block {index}: stored {stored}, packed {packed} ({packed / stored:.3f}x), "
            f"dequantized {dequantized} ({dequantized / stored:.2f}x)"
        )
        assert packed <= MAX_RESIDENT_OVER_STORED * stored, (index, packed, stored)
        assert packed < dequantized, (index, packed, dequantized)
