"""The fixed-size-state cache kinds beyond gated delta nets are exact in a real swarm.

A ``petals dht`` and two ``petals serve`` processes (blocks 0:2 and 2:4) serve a tiny random model saved
in the Hugging Face layout; the distributed model's greedy tokens (and logits) equal transformers'
``generate`` on the same files, and its logits equal transformers' after the session rolls back three
tokens and goes on with others (the servers restore the states they kept before those steps):

* short convolutions beside attention (LFM2: ``conv`` layers, whose cache is the convolution's last
  inputs and nothing else, then a full-attention layer on each server);
* a Mamba2 mixer beside attention in every layer (Falcon-H1's ``hybrid`` layers: a convolution's inputs
  and an SSM state per sequence, and keys and values per token, in one layer);
* delta attention beside latent attention (Kimi Linear: Kimi Delta Attention layers, a short convolution
  and a per-channel-decay delta rule state per sequence; a latent attention layer without positions,
  then routed and shared experts, on the second server).

A state the server stored wrong (not at all after a fused single-token step, say) shows in the logits
within a token: the SSM heads are made slow to forget, so that the state carries the session's history.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconH1Config, KimiLinearConfig, Lfm2Config

import petals
from conftest import LOOPBACK_CLIENT, save_random_model, slow_to_forget
from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, HybridSpec, LinearAttentionSpec
from petals.testing.swarm import running_swarm

PROMPT = 8
NEW_TOKENS = 16
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)
MODELS = {
    # each server holds a short convolution and a full-attention layer
    "short-convolutions-and-attention": Lfm2Config(
        **TINY, block_auto_adjust_ff_dim=False, conv_L_cache=3, layer_types=["conv", "full_attention"] * 2
    ),
    "mamba2-beside-attention": FalconH1Config(
        **TINY,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=4,
    ),
    # blocks 0:2 are delta attention layers; 2:4 the latent attention layer and one more delta layer
    "delta-and-latent-attention": KimiLinearConfig(
        **{**TINY, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        linear_num_heads=2,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    ),
}
SHORT_CONV = LinearAttentionSpec(conv_dim=64, conv_kernel=3, recurrent_shape=None)
MAMBA2 = LinearAttentionSpec(conv_dim=64 + 2 * 2 * 8, conv_kernel=4, recurrent_shape=(4, 16, 8))
DELTA = LinearAttentionSpec(conv_dim=3 * 2 * 16, conv_kernel=4, recurrent_shape=(2, 16, 16))
LATENT = FullAttentionSpec(num_kv_heads=1, key_dim=16, value_dim=8, num_query_heads=4)
SPECS = {  # what each block caches, as servers budget it
    "delta-and-latent-attention": [DELTA, DELTA, LATENT, DELTA],
    "short-convolutions-and-attention": [SHORT_CONV, FullAttentionSpec(**HEADS)] * 2,
    "mamba2-beside-attention": [HybridSpec(attention=FullAttentionSpec(**HEADS), state=MAMBA2)] * 4,
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_tokens_and_a_rollback_equal_transformers(kind, tmp_path):
    path = save_random_model(MODELS[kind], tmp_path / kind, adjust=slow_to_forget)
    ids = torch.randint(3, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(7))
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
        assert [cache_spec(model.config, index) for index in range(4)] == SPECS[kind]
        output = model.generate(ids, **kwargs)
        # a prompt and single random tokens (a tiny random model's greedy tokens soon repeat one token, and
        # then every recent state is alike), then a rollback past the last three (a state goes back to the
        # start of one of its last steps) and other tokens from there: the servers restore what they kept
        tokens = torch.randint(3, 1000, (1, PROMPT + 8), generator=torch.Generator().manual_seed(8))
        with model.inference_session(max_length=PROMPT + 8) as session:
            model(tokens[:, :PROMPT])
            for position in range(PROMPT, PROMPT + 6):
                model(tokens[:, position : position + 1])
            start = session.position - 3
            session.rollback(start)
            after_rollback = model(tokens[:, -2:]).logits
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    # tokens alone are coarse on a tiny random model: the logits show whether every cache is exact
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected_after = local(torch.cat([tokens[:, :start], tokens[:, -2:]], dim=1)).logits[:, -2:]
    assert (after_rollback - expected_after).abs().max().item() < 1e-4
