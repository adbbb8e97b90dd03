"""Each family of 2025-2026 generates exactly through a real swarm: a ``petals dht`` and two ``petals serve``
processes (blocks 0:2 and 2:4) serve a tiny random model saved in the Hugging Face layout, and the
distributed model's greedy tokens (and logits) equal transformers' ``generate`` on the same files.

Each model switches on what makes its family differ, and generates well past its window or chunk, so
the servers' sliding and chunked caches drop what fell out of them. The client keeps the embeddings, the
final norm and the LM head, with transformers' own code: Gemma's embeddings scaled by the square root of
the hidden size and Gemma 2's and 4's soft-capped logits are computed there. Add a family as a row of ``MODELS``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GemmaConfig,
    GptOssConfig,
    Llama4TextConfig,
    Ministral3Config,
    MistralConfig,
    SmolLM3Config,
)

import petals
from conftest import LOOPBACK_CLIENT, save_random_model
from petals.testing.swarm import running_swarm

WINDOW = 6  # every sliding window and attention chunk
PROMPT = 8
NEW_TOKENS = 16
VOCAB = 1000
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
)
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"] * 2
MODELS = {
    "gemma3_text": Gemma3TextConfig(
        **TINY, sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"]
    ),
    # each server holds a sliding layer (2 key/value heads of 16) and a full one (1 of 32, keys as values)
    "gemma4_text": Gemma4TextConfig(
        **TINY,
        sliding_window=WINDOW,
        layer_types=SLIDING_THEN_FULL,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        final_logit_softcapping=3.0,
        hidden_size_per_layer_input=0,
    ),
    "gemma2": Gemma2Config(
        **TINY,
        sliding_window=WINDOW,
        layer_types=SLIDING_THEN_FULL,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    "gemma": GemmaConfig(**{**TINY, "num_key_value_heads": 1}),
    "mistral": MistralConfig(**TINY, sliding_window=WINDOW),
    # yarn over an original context of 4 positions; queries scaled up every 4 positions
    "ministral3": Ministral3Config(
        **TINY,
        max_position_embeddings=16,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=4,
            beta_fast=32.0,
            beta_slow=1.0,
            llama_4_scaling_beta=0.5,
        ),
    ),
    "gpt_oss": GptOssConfig(
        **TINY,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=SLIDING_THEN_FULL,
    ),
    "llama4_text": Llama4TextConfig(
        **TINY,
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=WINDOW,
        no_rope_layers=[1, 1, 1, 0],
    ),
    "smollm3": SmolLM3Config(**TINY, no_rope_layers=[1, 0, 1, 0], pad_token_id=0),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_greedy_tokens_through_two_servers_equal_transformers(model_type, tmp_path):
    path = save_random_model(MODELS[model_type], tmp_path / model_type)
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(ids, **kwargs)

    with running_swarm(path, "0:2", "2:4") as (dht, _servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, request_timeout=20, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    # tokens alone are coarse on a tiny random model: the logits show whether every block and cache is exact
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4
