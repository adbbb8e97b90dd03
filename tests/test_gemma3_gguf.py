"""A real model served: Gemma 3 270M (Q4_K_M GGUF from PyPI) through three ``petals serve`` processes,
greedy tokens equal to transformers loading the same file, past its 512-token sliding window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GgufConfig

import petals
from conftest import LOOPBACK_CLIENT
from petals.cli.demo import GEMMA3_FACTS
from petals.demo_model import DEMO_MODELS, demo_packages_missing, prepare_demo_model
from petals.local_swarm import running_swarm

pytestmark = pytest.mark.slow
GEMMA3 = DEMO_MODELS["gemma3"]
missing = demo_packages_missing(GEMMA3)
if missing:
    pytest.skip(missing, allow_module_level=True)


def test_greedy_tokens_through_three_servers_equal_transformers_past_the_sliding_window(tmp_path):
    folder = prepare_demo_model(tmp_path, GEMMA3)
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
    assert reference.config.sliding_window == 512
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
