"""Mamba-2 and short-convolution states are served by core, for families with no plugin of their own.

Core's default cache description measures the state of a ``linear_attention``, ``conv`` or ``hybrid``
layer from the block its config builds (``petals.kv_cache.specs.measured_state``: a step of one token,
then one of two tokens, on the meta device into transformers' own linear-attention cache layer), so the
documented three-line plugin serves hybrids of attention and Mamba-2 (Bamba, dense; Granite 4.0-H, with
experts and no positions) and of attention and short convolutions (LFM2, dense; LFM2-MoE): each passes
the kit (rewinds to a kept snapshot and a failover's replay included), two servers generate
transformers' greedy tokens, and a speculative session's drafts, rejected in part, roll its states back
exactly. Falcon-H1's and LFM2's own plugins keep no sizes of their own: core's measurement equals what
they declared. A state core cannot measure, or one a layer ignores on a step of several tokens (Mamba-1),
stays unserved: refused in one line, never served wrong.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_speculative_state_kinds import repeating_prompt
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    FalconH1Config,
    GraniteMoeHybridConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    Mamba2Config,
    MambaConfig,
)
from transformers.models.bamba import modeling_bamba as bamba
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
from transformers.models.lfm2 import modeling_lfm2 as lfm2
from transformers.models.lfm2_moe import modeling_lfm2_moe as lfm2_moe
from transformers.models.mamba import modeling_mamba as mamba
from transformers.models.mamba2 import modeling_mamba2 as mamba2

import petals
from conftest import LOOPBACK_CLIENT, save_random_model, serving_only, slow_to_forget
from petals import hookimpl
from petals.block import RotaryBlockMixin, cache_spec
from petals.client.generation import StepStats
from petals.config import DistributedConfigMixin
from petals.kv_cache import FullAttentionSpec, HybridSpec, LinearAttentionSpec
from petals.kv_cache.specs import UnservedSpec, describe_block, measured_state
from petals.testing.conformance import check_family
from petals.testing.swarm import inprocess_swarm
from petals_falcon.config import DistributedFalconH1Config
from petals_lfm.config import DistributedLfm2Config


# Bamba's layer returns its attention weights beside its output, as the model's layer loop expects
class BambaBlock(RotaryBlockMixin, bamba.BambaDecoderLayer):
    rotary_class = bamba.BambaRotaryEmbedding

    def forward(self, hidden_states, cache=None, **layer_kwargs):
        return super().forward(hidden_states, cache, **layer_kwargs)[0]


class DistributedBambaConfig(DistributedConfigMixin, BambaConfig):
    block_class, attn_class = BambaBlock, bamba.BambaAttention
    block_prefix = "model.layers"
    block_output_is_tuple = True  # what the model's layer loop unpacks


class GraniteMoeHybridBlock(RotaryBlockMixin, granite.GraniteMoeHybridDecoderLayer):
    rotary_class = None  # Granite 4.0-H attends without positions (position_embedding_type "nope")


class DistributedGraniteMoeHybridConfig(DistributedConfigMixin, GraniteMoeHybridConfig):
    block_class, attn_class = GraniteMoeHybridBlock, granite.GraniteMoeHybridAttention
    block_prefix = "model.layers"


class Lfm2MoeBlock(RotaryBlockMixin, lfm2_moe.Lfm2MoeDecoderLayer):
    rotary_class = lfm2_moe.Lfm2MoeRotaryEmbedding


class DistributedLfm2MoeConfig(DistributedConfigMixin, Lfm2MoeConfig):
    block_class, attn_class = Lfm2MoeBlock, lfm2_moe.Lfm2MoeAttention
    block_prefix = "model.layers"


class Lfm2Block(RotaryBlockMixin, lfm2.Lfm2DecoderLayer):
    rotary_class = lfm2.Lfm2RotaryEmbedding


class DistributedLfm2ThreeLineConfig(DistributedConfigMixin, Lfm2Config):
    block_class, attn_class = Lfm2Block, lfm2.Lfm2Attention
    block_prefix = "model.layers"


def three_line_plugin(config_class: type) -> object:
    class ThreeLinePlugin:
        @hookimpl
        def register_model_families(self, register):
            register(config_class)

    return ThreeLinePlugin()


TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)
# every layer kind of each published config, a state-keeping layer and an attention layer on each server
MAMBA2 = dict(mamba_n_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4)
FAMILIES = {
    # attention + Mamba-2, dense (Bamba-9B: 3 attention layers in 32, rope on half of each head)
    "bamba": (
        DistributedBambaConfig,
        BambaConfig(**TINY, **MAMBA2, mamba_n_groups=2, attn_layer_indices=[1, 3]),
    ),
    # attention + Mamba-2 + experts beside a shared MLP, no positions, muP multipliers (Granite 4.0-H)
    "granitemoehybrid": (
        DistributedGraniteMoeHybridConfig,
        GraniteMoeHybridConfig(
            **TINY,
            **MAMBA2,
            mamba_n_groups=1,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
            position_embedding_type="nope",
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0625,
            logits_scaling=6.0,
        ),
    ),
    # attention + short convolutions + experts after a dense first layer (LFM2-8B-A1B)
    "lfm2_moe": (
        DistributedLfm2MoeConfig,
        Lfm2MoeConfig(
            **TINY,
            moe_intermediate_size=32,
            conv_L_cache=3,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            layer_types=["conv", "full_attention"] * 2,
        ),
    ),
    # attention + short convolutions, dense (LFM2)
    "lfm2": (
        DistributedLfm2ThreeLineConfig,
        Lfm2Config(
            **TINY, block_auto_adjust_ff_dim=False, conv_L_cache=3, layer_types=["conv", "full_attention"] * 2
        ),
    ),
}
HEADS = FullAttentionSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SHORT_CONV = LinearAttentionSpec(conv_dim=64, conv_kernel=3, recurrent_shape=None)
# Mamba-2: a convolution over x (2 x 64 channels) and B and C (groups x 8 each); a float32 state per head
SPECS = {
    "bamba": [
        LinearAttentionSpec(conv_dim=128 + 2 * 2 * 8, conv_kernel=4, recurrent_shape=(4, 32, 8)),
        HEADS,
    ]
    * 2,
    "granitemoehybrid": [
        LinearAttentionSpec(conv_dim=128 + 2 * 1 * 8, conv_kernel=4, recurrent_shape=(4, 32, 8)),
        HEADS,
    ]
    * 2,
    "lfm2_moe": [SHORT_CONV, HEADS] * 2,
    "lfm2": [SHORT_CONV, HEADS] * 2,
}


def distributed(family: str):
    config_class, config = FAMILIES[family]
    return config_class.from_dict(config.to_dict())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_core_measures_each_state_from_the_block(family):
    with serving_only(three_line_plugin(FAMILIES[family][0]), name=f"{family}-three-lines"):
        assert [cache_spec(distributed(family), index) for index in range(4)] == SPECS[family]


def test_core_measures_what_the_falcon_h1_and_lfm2_plugins_declared():
    """The sizes those plugins wrote from their configs' fields, for tiny and published configs."""
    for config in (
        DistributedFalconH1Config.from_dict(
            FalconH1Config(**TINY, **MAMBA2, mamba_d_ssm=64, mamba_d_head=16, mamba_n_groups=2).to_dict()
        ),
        DistributedFalconH1Config(),  # transformers' default sizes
        DistributedFalconH1Config(mamba_d_ssm=None, mamba_expand=2, mamba_d_head=64),
    ):
        inner = config.mamba_d_ssm or config.mamba_expand * config.hidden_size
        declared = LinearAttentionSpec(
            conv_dim=inner + 2 * config.mamba_n_groups * config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            recurrent_shape=(config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state),
        )
        spec = describe_block(config, 0)
        assert isinstance(spec, HybridSpec) and spec.state == declared
    for config in (distributed("lfm2"), DistributedLfm2Config()):
        for index, layer_type in enumerate(config.layer_types):
            if layer_type == "conv":
                declared = LinearAttentionSpec(config.hidden_size, config.conv_L_cache, recurrent_shape=None)
                assert describe_block(config, index) == declared


def test_a_state_core_cannot_measure_is_refused_not_guessed():
    # a config with no block class to build (transformers' own)
    assert describe_block(FAMILIES["bamba"][1], 0) == UnservedSpec("linear_attention")

    class TwoConvolutions(torch.nn.Module):  # which is the cached one?
        def __init__(self):
            super().__init__()
            self.q_conv, self.k_conv = (torch.nn.Conv1d(8, 8, 4, groups=8) for _ in range(2))

    class NeedsValues(torch.nn.Module):  # the meta device has no values to branch on
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(8, 8, 4, groups=8)

        def forward(self, hidden_states, cache=None):
            return hidden_states if hidden_states.sum().item() > 0 else None

    # transformers' Mamba-1 mixer: its state's sizes are plain to see, but a step of several tokens scans from
    # a zero state, whatever state the session's earlier steps left (transformers' own TODO says so): a
    # second chat turn or a speculative draft would be computed wrong
    mamba_config = MambaConfig(hidden_size=64, state_size=8, num_hidden_layers=2, vocab_size=1000)
    mamba2_config = Mamba2Config(
        hidden_size=64,
        num_heads=8,
        head_dim=16,
        n_groups=2,
        state_size=8,
        num_hidden_layers=2,
        vocab_size=1000,
    )
    with torch.device("meta"):
        assert measured_state(TwoConvolutions(), 0, 8) is None
        assert measured_state(NeedsValues(), 0, 8) is None
        assert measured_state(mamba.MambaBlock(mamba_config, 1), 1, 64) is None
        assert measured_state(mamba2.Mamba2Block(mamba2_config, 1), 1, 64) == LinearAttentionSpec(
            conv_dim=128 + 2 * 2 * 8, conv_kernel=4, recurrent_shape=(8, 16, 8)
        )


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_three_line_plugin_passes_the_kit(family, tmp_path):
    with serving_only(three_line_plugin(FAMILIES[family][0]), name=f"{family}-three-lines"):
        report = check_family(FAMILIES[family][1], tmp_path)
    assert report.cache_specs == SPECS[family]
    assert max(report.max_abs_diff.values()) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_servers_generate_greedy_tokens_and_roll_drafts_back(family, tmp_path, caplog):
    path = save_random_model(FAMILIES[family][1], tmp_path / family, adjust=slow_to_forget)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = repeating_prompt()
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    expected = local.generate(ids, output_logits=True, return_dict_in_generate=True, **greedy)
    prompt, tokens = 8, torch.randint(3, 1000, (1, 14), generator=torch.Generator().manual_seed(8))

    caplog.set_level(logging.WARNING, logger="petals.client")
    with serving_only(three_line_plugin(FAMILIES[family][0]), name=f"{family}-three-lines"):
        with inprocess_swarm(path, "0:2", "2:4") as (dht, _servers):
            model = petals.AutoDistributedModelForCausalLM.from_pretrained(
                path, initial_peers=dht.initial_peers, request_timeout=20, **LOOPBACK_CLIENT
            )
            try:
                got = model.generate(ids, output_logits=True, return_dict_in_generate=True, **greedy)
                with StepStats(model) as stats:  # prompt lookup: drafts of 3, the random model rejects most
                    drafted = model.generate(ids, prompt_lookup_num_tokens=3, **greedy)
                # a step of four tokens kept to its first one (the servers rewind to its start and are sent
                # that token again in front of the next step), then a rollback inside that next step
                with torch.no_grad(), model.inference_session(max_length=14) as session:
                    model(tokens[:, :prompt])
                    model(tokens[:, prompt : prompt + 4])
                    session.rollback(prompt + 1)
                    after_first = model(tokens[:, prompt + 4 : prompt + 6]).logits
                    session.rollback(prompt + 2)
                    after_second = model(tokens[:, prompt + 1 : prompt + 3]).logits
            finally:
                model.close()

    failures = [record.getMessage() for record in caplog.records if record.name.startswith("petals.client")]
    assert not failures, failures
    assert torch.equal(got.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, expected.logits, strict=True))
    assert diff < 1e-4
    assert stats.rolled_back(drafted.shape[1]) > 0, f"no draft was rejected: steps of {stats.lengths}"
    assert torch.equal(drafted, expected.sequences)
    first = torch.cat([tokens[:, : prompt + 1], tokens[:, prompt + 4 : prompt + 6]], dim=1)
    second = torch.cat([first[:, : prompt + 2], tokens[:, prompt + 1 : prompt + 3]], dim=1)
    with torch.no_grad():
        assert (after_first - local(first).logits[:, -2:]).abs().max().item() < 1e-4
        assert (after_second - local(second).logits[:, -2:]).abs().max().item() < 1e-4
