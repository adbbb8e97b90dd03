"""Layers that cache nothing: a model whose layer types list feed-forward or experts layers beside its
attention and state layers is served, those blocks taking no memory.

Nemotron-H (NVIDIA's Nemotron-H and Nemotron 3 families) builds every layer from one class whose mixer is,
by ``layer_types``, a Mamba-2 mixer, attention without rotary embeddings, experts or a feed-forward
network; transformers' cache keeps a placeholder for the last two (kind "dummy"). Through the
three-line plugin (no rotary class), the kit passes and two servers generate transformers' greedy tokens.
"""

import torch
from transformers import AutoModelForCausalLM, NemotronHConfig
from transformers.models.nemotron_h import modeling_nemotron_h as nemotron_h

import petals
from conftest import LOOPBACK_CLIENT, save_random_model, serving_only, slow_to_forget
from petals import hookimpl
from petals.block import RotaryBlockMixin, cache_spec
from petals.config import DistributedConfigMixin
from petals.kv_cache import FullAttentionSpec, LinearAttentionSpec, StatelessSpec
from petals.testing.conformance import check_family
from petals.testing.swarm import inprocess_swarm


class NemotronHServerBlock(RotaryBlockMixin, nemotron_h.NemotronHBlock):
    rotary_class = None


class DistributedNemotronHConfig(DistributedConfigMixin, NemotronHConfig):
    block_class, attn_class, block_prefix = (
        NemotronHServerBlock,
        nemotron_h.NemotronHAttention,
        "model.layers",
    )


class ThreeLinePlugin:
    @hookimpl
    def register_model_families(self, register):
        register(DistributedNemotronHConfig)


# each mixer of the published pattern, twice, so that each of two servers holds all four kinds
TINY = NemotronHConfig(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=1000, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"] * 2,
    ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, chunk_size=16,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, use_mamba_kernels=False,
)  # fmt: skip


def test_feed_forward_layers_cache_nothing_and_the_kit_passes(tmp_path):
    with serving_only(ThreeLinePlugin(), name="nemotron-h-three-lines") as manager:
        config = manager.family("nemotron_h").config_class.from_dict(TINY.to_dict())
        kinds = [type(cache_spec(config, index)) for index in range(8)]
        assert kinds == [LinearAttentionSpec, StatelessSpec, FullAttentionSpec, StatelessSpec] * 2
        assert cache_spec(config, 1).bytes_per_token(torch.bfloat16) == 0
        report = check_family(TINY, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5


def test_two_servers_generate_transformers_greedy_tokens_and_roll_back(tmp_path):
    path = save_random_model(TINY, tmp_path / "Nemotron-H-Tiny", adjust=slow_to_forget)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, output_logits=True)
    kwargs.update(return_dict_in_generate=True)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = local.generate(ids, **kwargs)
    tokens = torch.randint(3, 1000, (1, 14), generator=torch.Generator().manual_seed(8))
    with serving_only(ThreeLinePlugin(), name="nemotron-h-three-lines"):
        with inprocess_swarm(path, "0:4", "4:8") as (dht, _):
            model = petals.AutoDistributedModelForCausalLM.from_pretrained(
                path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
            try:
                got = model.generate(ids, **kwargs)
                # single tokens, then a rollback past the last three, as speculative decoding does: the
                # state layers restore a snapshot, the others rewind their length
                with torch.no_grad(), model.inference_session(max_length=14) as session:
                    model(tokens[:, :6])
                    for position in range(6, 12):
                        model(tokens[:, position : position + 1])
                    start = session.position - 3
                    session.rollback(start)
                    after_rollback = model(tokens[:, -2:]).logits
            finally:
                model.close()
    assert torch.equal(got.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, expected.logits, strict=True))
    assert diff < 1e-4
    with torch.no_grad():
        expected_after = local(torch.cat([tokens[:, :start], tokens[:, -2:]], dim=1)).logits[:, -2:]
    assert (after_rollback - expected_after).abs().max().item() < 1e-4
