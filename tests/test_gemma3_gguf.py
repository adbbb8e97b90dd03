"""A real model served: Gemma 3 270M (Q4_K_M GGUF from PyPI) through three ``petals serve`` processes,
greedy tokens equal to transformers loading the same file, past its 512-token sliding window; its blocks,
quantized by llama.cpp itself, dequantized bit for bit as gguf does and its Q4_K matrices run on torch's
int4 kernel in bfloat16; and ``petals demo --model gemma3``, which serves it the same way and prints each
server's cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, GgufConfig

import petals
from conftest import LOOPBACK_CLIENT
from petals.cli.demo import GEMMA3_FACTS
from petals.demo_model import DEMO_MODELS, demo_packages_missing, prepare_demo_model
from petals.formats.gguf import GgufInt4Weight, reader
from petals.formats.gguf_quants import dequantize
from petals.formats.packed import packed_weights
from petals.loading import load_block
from petals.local_swarm import running_swarm

pytestmark = pytest.mark.slow
GEMMA3 = DEMO_MODELS["gemma3"]
missing = demo_packages_missing(GEMMA3)
if missing:
    pytest.skip(missing, allow_module_level=True)


@pytest.fixture(scope="module")
def gemma3_cache(tmp_path_factory):
    """A cache folder holding the assembled GGUF file, assembled once for this module's tests."""
    cache_dir = tmp_path_factory.mktemp("petals-cache")
    prepare_demo_model(cache_dir, GEMMA3)
    return cache_dir


def test_llama_cpp_blocks_dequantize_as_gguf_does_and_q4_k_runs_on_the_int4_kernel(gemma3_cache):
    """Blocks written by llama.cpp's own quantizer (Q5_0, Q4_K, Q6_K, Q8_0 in a Q4_K_M build): torch's
    dequantization equals gguf's bit for bit, and in bfloat16 the Q4_K output projection runs on the
    int4 kernel within a bfloat16 rounding of the block dequantized at load."""
    from gguf.quants import dequantize as numpy_dequantize

    path = prepare_demo_model(gemma3_cache, GEMMA3) / GEMMA3.gguf_file
    stored = {tensor.name: tensor for tensor in reader(path).tensors}
    kinds = {"attn_q": "Q5_0", "attn_output": "Q4_K", "ffn_down": "Q6_K", "attn_v": "Q8_0"}
    for short, kind in kinds.items():
        tensor = stored[f"blk.0.{short}.weight"]
        assert tensor.tensor_type.name == kind
        raw = np.asarray(tensor.data)
        expected = numpy_dequantize(raw, tensor.tensor_type)
        values = dequantize(torch.from_numpy(raw), tensor.tensor_type, torch.float32, expected.shape)
        assert np.array_equal(values.numpy().view(np.uint32), expected.view(np.uint32)), kind

    packed = load_block(path, 0, torch.bfloat16)
    dense = load_block(path, 0, torch.bfloat16, weights="dequantized")
    assert isinstance(packed_weights(packed)["self_attn.o_proj.weight"], GgufInt4Weight)
    hidden = torch.randn(1, 7, packed.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output = packed(hidden)
    assert any("int4pack_mm" in event.key for event in profile.key_averages())
    expected = dense(hidden)
    assert (output.float() - expected.float()).abs().max() <= 0.01 * expected.float().abs().max()


def test_greedy_tokens_through_three_servers_equal_transformers_past_the_sliding_window(gemma3_cache):
    folder = prepare_demo_model(gemma3_cache, GEMMA3)  # prepared already: the folder at once
    gguf = folder / GEMMA3.gguf_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer(GEMMA3_FACTS * 14 + "Warsaw is the capital of", return_tensors="pt")["input_ids"]
    long_prompt = text  # longer than the window: sliding layers drop tokens from the first step
    crossing = text[:, :506]  # shorter than the window: the generation crosses it
    assert long_prompt.shape[1] > 512 and crossing.shape[1] < 512
    reference = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    ).eval()
    assert reference.config.model_type == "gemma3_text" and reference.config.sliding_window == 512
    kwargs = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = [
        reference.generate(long_prompt, max_new_tokens=4, **kwargs),
        reference.generate(crossing, max_new_tokens=10, **kwargs),
    ]
    del reference

    with running_swarm(folder, *GEMMA3.server_ranges, timeout=300) as (dht, _servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            gguf, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        try:
            outputs = [
                model.generate(long_prompt, max_new_tokens=4, **kwargs),
                model.generate(crossing, max_new_tokens=10, **kwargs),
            ]
        finally:
            model.close()
    for output, want in zip(outputs, expected, strict=True):
        assert torch.equal(output.sequences, want.sequences)
        diff = max((a - b).abs().max().item() for a, b in zip(output.logits, want.logits, strict=True))
        assert diff < 1e-3


def test_the_demo_answers_and_prints_each_servers_cache_beside_full_attention(gemma3_cache):
    result = subprocess.run(
        [sys.executable, "-m", "petals.cli", "demo", "--model", "gemma3", "--cache_dir", str(gemma3_cache)]
        + ["--max_new_tokens", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "first run only" not in result.stdout  # the fixture assembled the model
    answer = next(line for line in result.stdout.splitlines() if line.startswith("A: "))
    assert "Poland" in answer, result.stdout  # "Warsaw is the capital of" Poland, greedily
    # one line per server: MiB held, MiB with full attention, the ratio; sliding layers hold their window
    cache_lines = re.findall(
        r"blocks +(\d+):(\d+) +[\d.]+ MiB held, +[\d.]+ MiB with full attention \(([\d.]+)x\)  \[(.*)\]",
        result.stdout,
    )
    assert [(int(start), int(end)) for start, end, _, _ in cache_lines] == [(0, 6), (6, 12), (12, 18)]
    for _, _, ratio, kinds in cache_lines:
        assert float(ratio) > 1 and kinds == "full attention, sliding attention (512)", result.stdout
    assert "Done." in result.stdout
    leftovers = [
        p.info
        for p in psutil.process_iter(["pid", "cmdline"])
        if str(gemma3_cache) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []
