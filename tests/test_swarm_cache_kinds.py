"""Each cache kind servers hold is exact in a real swarm, through a server killed mid-generation.

A ``petals dht`` and three ``petals serve`` processes (blocks 0:2, 2:4 and a replica of 2:4) serve a tiny
random model saved in the Hugging Face layout; the distributed model's greedy tokens equal transformers'
``generate`` on the same files, while the server of blocks 2:4 in the session's route is SIGKILLed mid-way
and its replica rebuilds that cache from the session's history (logits equal too):

* sliding window (Qwen2, window 8, sliding and full layers on each server): the kill comes past what a
  server keeps of a window (the window and the rewind margin), so both the killed server and its
  replica, after replaying that history, have given pages back;
* full attention with keys and values of their own widths, layers that differ by index (DeepSeek V3:
  its latent of 16 values and rope key of 8, a dense first layer, then shared and routed experts);
* indexed attention (GLM-5: DeepSeek's latent beside a sparse-attention indexer whose keys are paged with
  it, 4 tokens picked of up to 104, 8 indexer heads; a dense first layer, then experts): the replica rebuilds
  the latent and the indexer keys alike;
* linear attention (Qwen3-Next: three gated delta net layers, then a full-attention one, each with routed
  experts and a shared expert): a fixed-size state per sequence, which the replica of the killed server
  (a linear layer and the full one) rebuilds by replaying the history through the recurrence;
* layers that reuse keys and values (Gemma 4 of 6 layers, sliding and full in turn: layers 4 and 5 attend
  with those layers 2 and 3 compute in the same pass, and cache nothing): blocks 2:6 stay on one server
  (servers of 0:2, 2:6 and a replica of 2:6), and the replica rebuilds the sources' caches alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma4TextConfig,
    GlmMoeDsaConfig,
    Qwen2Config,
    Qwen3NextConfig,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

import petals
from conftest import LOOPBACK_CLIENT, KillServingServer, save_random_model
from petals.block import cache_spec
from petals.client.routing import MissingBlocksError
from petals.data_structures import make_uids
from petals.kv_cache import (
    REWIND_MARGIN,
    FullAttentionSpec,
    IndexedAttentionSpec,
    LinearAttentionSpec,
    SharedKVSpec,
    SlidingWindowSpec,
)
from petals.testing.swarm import running_swarm
from petals.testing.wire_client import WireClient

WINDOW = 8
PROMPT = 8
# past what a sliding layer keeps (its window and REWIND_MARGIN): the killed server has given pages back,
# and its replica replays a history longer than that, then gives pages back itself
KILL_AFTER = WINDOW + REWIND_MARGIN
NEW_TOKENS = KILL_AFTER + 24

MODELS = {
    "sliding-window": Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "latent-dense-then-experts": DeepseekV3Config(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1000,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
    ),
    "latent-indexed-sparse": GlmMoeDsaConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1000,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        index_topk=4,
        index_head_dim=16,
        index_n_heads=8,
    ),
    # blocks 2:4, the killed server's, are a linear layer and the full one
    "linear-then-full-attention": Qwen3NextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    # transformers 5.24 runs a Gemma 4 that shares keys and values without per-layer embeddings only
    # when asked for its hidden states (else it slices per_layer_inputs, None then)
    "shared-keys-and-values": Gemma4TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 3,
        global_head_dim=16,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=0,
        output_hidden_states=True,
    ),
}
SPANS = {"shared-keys-and-values": ("0:2", "2:6", "2:6")}  # the others: 0:2, 2:4 and 2:4
# the full attention of the Qwen2 and Qwen3-Next models: 4 query heads, 2 key/value heads of 16
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
# a convolution over queries and keys (2 heads x 8) and values (4 heads x 8); an 8 x 8 state per value head
GATED_DELTA_NET = LinearAttentionSpec(conv_dim=2 * 16 + 32, conv_kernel=4, recurrent_shape=(4, 8, 8))
SPECS = {  # what each block caches, as servers budget it
    "sliding-window": [SlidingWindowSpec(**HEADS, window=WINDOW), FullAttentionSpec(**HEADS)] * 2,
    "latent-dense-then-experts": [
        FullAttentionSpec(num_kv_heads=1, key_dim=16, value_dim=8, num_query_heads=4)
    ]
    * 4,
    "latent-indexed-sparse": [
        IndexedAttentionSpec(num_kv_heads=1, key_dim=16, value_dim=8, num_query_heads=4, index_dim=16)
    ]
    * 4,
    "linear-then-full-attention": [GATED_DELTA_NET] * 3 + [FullAttentionSpec(**HEADS)],
    "shared-keys-and-values": [SlidingWindowSpec(**HEADS, window=WINDOW), FullAttentionSpec(**HEADS)] * 2
    + [
        SharedKVSpec(2, SlidingWindowSpec(**HEADS, window=WINDOW)),
        SharedKVSpec(3, FullAttentionSpec(**HEADS)),
    ],
}


def slow_to_forget(model: torch.nn.Module) -> None:
    """A gated delta net head's state decays by exp(-A softplus(...)) a token, and transformers draws A from
    [0.01, 16]: a random model's heads forget within a token, so a replica's state rebuilt wrong would hardly
    show (zeroing it at the kill moves the logits by 1e-4, once). With A = 0.01 each head keeps the session's
    history (the same zeroing moves them by 0.08 at once, by up to 0.9 later)."""
    for module in model.modules():
        if isinstance(module, Qwen3NextGatedDeltaNet):
            torch.nn.init.constant_(module.A_log, math.log(0.01))


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_tokens_equal_transformers_through_a_killed_server(kind, tmp_path):
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

    server_args = ("--update_period", "3")  # a killed server's records expire within seconds
    spans = SPANS.get(kind, ("0:2", "2:4", "2:4"))
    with running_swarm(path, *spans, server_args=server_args) as (dht, servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, request_timeout=20, **LOOPBACK_CLIENT
        )
        assert [cache_spec(model.config, index) for index in range(len(SPECS[kind]))] == SPECS[kind]
        with model.inference_session(max_length=PROMPT + NEW_TOKENS) as session:
            killer = KillServingServer(session, servers, PROMPT, KILL_AFTER)
            output = model.generate(ids, stopping_criteria=[killer], **kwargs)
            survivors = {str(span.peer_id) for span in session.route}
        model.close()
    if kind == "shared-keys-and-values":  # placement says why these blocks go together
        for server in servers[1:]:
            assert "Blocks 2:6 share keys and values" in server.log, server.log
    assert killer.killed is not None, "the session never reached the kill point"
    assert killer.killed.peer_id not in survivors
    assert torch.equal(output.sequences, expected.sequences)
    # tokens alone are coarse on a tiny random model: the logits show whether every cache is exact
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4


@pytest.mark.slow
def test_a_session_longer_than_each_blocks_share_runs_on_what_the_sliding_blocks_do_not_hold(tmp_path):
    """One ``petals serve`` of the sliding-window model (sliding and full layers in turn) with a budget of
    128 tokens of each block's kind: 32 pages of 16 tokens its 4 blocks share. A sliding block never holds
    more than its window and rewind margin (6 pages), so a session of 160 tokens fits, whose full blocks
    hold 10 pages each (a pool of 128 tokens per block refused it); one of 161 does not: the server
    announces so (``cache_tokens_left``: 2 x 4 blocks x 160), and refuses one in one line."""
    path = save_random_model(MODELS["sliding-window"], tmp_path / "sliding")
    ids = torch.randint(3, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    longest = 160
    kwargs = dict(max_new_tokens=longest - PROMPT, min_new_tokens=longest - PROMPT, do_sample=False)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(ids, **kwargs)
    with running_swarm(path, "0:4", server_args=("--attn_cache_tokens", "128")) as (dht, (server,)):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, request_timeout=20, **LOOPBACK_CLIENT
        )
        try:
            with model.inference_session(max_length=longest) as session:
                output = model.generate(ids, session=session, **kwargs)
            assert torch.equal(output, expected)
            with pytest.raises(MissingBlocksError, match="no server has KV cache left for a session of 161"):
                with model.inference_session(max_length=longest + 1) as session:
                    model.generate(ids, session=session, max_new_tokens=1)
        finally:
            model.close()
        client = WireClient(dht.initial_peers)  # asked anyway, the server refuses it
        try:
            assert client.info(server.peer_id)["cache_tokens_available"] == 2 * 4 * longest
            stream = client.inference(server.peer_id, make_uids("sliding", 0, 4), max_length=longest + 1)
            with pytest.raises(
                P2PHandlerError,
                match=r"161 tokens: 1 × 34 pages of 4.0 KiB\) but the server.s whole budget is 128.0 KiB",
            ):
                stream.step(torch.randn(1, PROMPT, 64))
        finally:
            client.close()
