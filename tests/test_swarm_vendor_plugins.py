"""The families of petals-glm, petals-olmo, petals-phi and petals-granite generate exactly through real
processes: a ``petals dht`` and two ``petals serve`` (blocks 0:2 and 2:4) serve a tiny random model saved
in the Hugging Face layout, and the distributed model's greedy tokens and logits equal transformers'
``generate`` on the same files. Each model switches on what its family adds:

* glm4_moe: a dense first layer (``first_k_dense_replace``), then a shared expert and routed experts
  chosen by group (``n_group``); each server starts at its blocks' real layer index;
* olmo3: sliding layers (a window shorter than the generation) and a full-attention one on each server;
* phimoe: routed experts with sparsemixer routing and a sliding window on every layer;
* granite: the multipliers, two in the layers (attention, residual: the servers) and two around them
  (embedding, logits: the client's transformers model).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Glm4MoeConfig, GraniteConfig, Olmo3Config, PhimoeConfig

import petals
from conftest import LOOPBACK_CLIENT, save_random_model
from petals.testing.swarm import running_swarm

WINDOW = 6
PROMPT = 6
NEW_TOKENS = 12  # past every window
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    pad_token_id=0,
)
MODELS = {
    "glm4_moe": Glm4MoeConfig(
        **TINY,
        head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
    ),
    "olmo3": Olmo3Config(
        **TINY, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2
    ),
    "phimoe": PhimoeConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    "granite": GraniteConfig(
        **TINY,
        embedding_multiplier=12.0,
        logits_scaling=8.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_greedy_tokens_equal_transformers(model_type, tmp_path):
    path = save_random_model(MODELS[model_type], tmp_path / model_type)
    ids = torch.randint(3, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(ids, **kwargs)

    with running_swarm(path, "0:2", "2:4") as (dht, _):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    # tokens alone are coarse on a tiny random model: the logits show every block and multiplier exact
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4
