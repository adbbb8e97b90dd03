"""The families added for 2026 generate exactly through real processes: a ``petals dht`` and two
``petals serve`` (blocks 0:2 and 2:4) serve a tiny random model saved in the Hugging Face layout, and
the distributed model's greedy tokens and logits equal transformers' ``generate`` on the same files.
One model per vendor's plugin, each switching on what its family adds:

* qwen3_5_moe_text (petals-qwen): a gated delta net layer (a fixed-size state per sequence) and a
  full-attention one with partial multimodal rotary on each server; routed and gated shared experts;
* cohere2 (petals-cohere): sliding layers (a window shorter than the generation) and a full-attention
  layer without positions on each server; the client's head scales the logits;
* exaone4 (petals-exaone): the same mix of windows, with q/k norms and norms after attention and MLP;
* ernie4_5_moe (petals-ernie): a dense layer, then experts, on the first server; experts, then a dense
  layer (past ``moe_layer_end_index``), on the second, each block at its real layer index;
* dots1 (petals-dots): a dense first layer, then a shared expert and routed experts chosen by group;
  full attention on the first server, sliding layers on the second (``max_window_layers``);
* minimax_m2 (petals-minimax): partial rotary and routed experts with sigmoid scores.

The MoE routers' score correction biases are drawn at random (transformers starts them at zero), so
that a server reading them wrong picks other experts.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Cohere2Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Exaone4Config,
    MiniMaxM2Config,
    Qwen3_5MoeTextConfig,
)

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
    bos_token_id=1,
    eos_token_id=2,
)
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"] * 2
MODELS = {
    "qwen3_5_moe_text": Qwen3_5MoeTextConfig(
        **TINY,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "cohere2": Cohere2Config(**TINY, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, logit_scale=0.25),
    "exaone4": Exaone4Config(**TINY, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    "ernie4_5_moe": Ernie4_5_MoeConfig(
        **TINY,
        use_bias=True,
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_end_index=2,
    ),
    "dots1": Dots1Config(
        **TINY,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        sliding_window=WINDOW,
        max_window_layers=2,
    ),
    "minimax_m2": MiniMaxM2Config(
        **{**TINY, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        rotary_dim=8,
    ),
}


def remembering_and_biased(model: torch.nn.Module) -> None:
    """Gated delta net heads that keep the session's history (transformers' random decay forgets within
    a token), and random score correction biases of about the spread of the routers' scores."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log"):
                tensor.fill_(math.log(0.01))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.02 * torch.randn(tensor.shape, generator=generator))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_greedy_tokens_equal_transformers(model_type, tmp_path):
    path = save_random_model(MODELS[model_type], tmp_path / model_type, adjust=remembering_and_biased)
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
    # tokens alone are coarse on a tiny random model: the logits show every block and cache exact
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4
