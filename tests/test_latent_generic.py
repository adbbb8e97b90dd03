"""A family with DeepSeek-style latent attention and no plugin of its own is served by the documented
three-line plugin: core reads the latent from the attention transformers builds for it.

GLM-4.7-Flash (``glm4_moe_lite``) attends as DeepSeek V3 does (multi-head latent attention: each token's
compressed latent and one rope key shared by all heads are what the layer hands its cache, expanded per
head only after reading it), a dense first layer, then shared and routed experts. No installed plugin
serves it; its three-line plugin passes the kit, two servers generate transformers' greedy tokens, and
the servers budget the latent's bytes per token, not those of expanded keys and values.
"""

import torch
from transformers import AutoModelForCausalLM, Glm4MoeLiteConfig, LlamaConfig
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as glm4_moe_lite
from transformers.models.llama.modeling_llama import LlamaAttention

import petals
from conftest import LOOPBACK_CLIENT, save_random_model, serving_only
from petals import hookimpl
from petals.block import RotaryBlockMixin, cache_spec
from petals.config import DistributedConfigMixin
from petals.data_structures import make_uids
from petals.kv_cache import FullAttentionSpec
from petals.kv_cache.specs import latent_widths
from petals.testing.conformance import check_family
from petals.testing.swarm import inprocess_swarm
from petals.testing.wire_client import WireClient


class Glm4MoeLiteBlock(RotaryBlockMixin, glm4_moe_lite.Glm4MoeLiteDecoderLayer):
    rotary_class = glm4_moe_lite.Glm4MoeLiteRotaryEmbedding


class DistributedGlm4MoeLiteConfig(DistributedConfigMixin, Glm4MoeLiteConfig):
    block_class, attn_class = Glm4MoeLiteBlock, glm4_moe_lite.Glm4MoeLiteAttention
    block_prefix = "model.layers"


class ThreeLinePlugin:
    @hookimpl
    def register_model_families(self, register):
        register(DistributedGlm4MoeLiteConfig)


# every layer kind of the published config: latent attention with a low-rank query and interleaved rope,
# a dense first layer, then group-limited routed experts beside a shared one; 4 query heads of 8 + 8 key
# and 12 value values, a latent of 16 and a rope key of 8
TINY = Glm4MoeLiteConfig(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
)  # fmt: skip
LATENT = FullAttentionSpec(num_kv_heads=1, key_dim=16, value_dim=8, num_query_heads=4)
LATENT_BYTES = (16 + 8) * 4  # per token per layer in float32; expanded: 4 heads x (16 + 12) x 4 = 448


def test_core_reads_the_latent_from_the_attention_module_transformers_builds():
    with torch.device("meta"):
        assert latent_widths(glm4_moe_lite.Glm4MoeLiteAttention(TINY, 0)) == (16, 8)
        assert latent_widths(LlamaAttention(LlamaConfig(hidden_size=64, num_attention_heads=4), 0)) is None
    with serving_only(ThreeLinePlugin(), name="glm4-moe-lite-three-lines") as manager:
        config = manager.family("glm4_moe_lite").config_class.from_dict(TINY.to_dict())
        assert [cache_spec(config, index) for index in range(4)] == [LATENT] * 4
        # its published sizes: 512 + 64 values per token, not 20 heads x (256 + 256 key and value values)
        published = manager.family("glm4_moe_lite").config_class()
        assert cache_spec(published, 5).bytes_per_token(torch.bfloat16) == (512 + 64) * 2


def test_the_three_line_plugin_passes_the_kit(tmp_path):
    with serving_only(ThreeLinePlugin(), name="glm4-moe-lite-three-lines"):
        report = check_family(TINY, tmp_path)
    assert report.cache_specs == [LATENT] * 4
    assert report.cache_specs[0].bytes_per_token(torch.float32) == LATENT_BYTES
    assert max(report.max_abs_diff.values()) <= 1e-5


def test_two_servers_generate_transformers_greedy_tokens_on_latent_pages(tmp_path):
    path = save_random_model(TINY, tmp_path / "GLM-Lite-Tiny")
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(
        max_new_tokens=24,
        min_new_tokens=24,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().generate(ids, **kwargs)
    tokens_per_block = 128
    server_args = ("--attn_cache_tokens", str(tokens_per_block))
    with serving_only(ThreeLinePlugin(), name="glm4-moe-lite-three-lines"):
        with inprocess_swarm(path, "0:2", "2:4", server_args=server_args) as (dht, _):
            model = petals.AutoDistributedModelForCausalLM.from_pretrained(
                path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
            client = WireClient(dht.initial_peers)
            try:
                got = model.generate(ids, **kwargs)
                infos = client.module_infos(make_uids(model.config.dht_prefix, 0, 4))
            finally:
                client.close()
                model.close()
    assert torch.equal(got.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, expected.logits, strict=True))
    assert diff < 1e-4
    # each server's budget: its 2 blocks x 128 tokens of the latent and rope key, not of expanded heads
    budgets = {peer: server.cache_bytes for info in infos for peer, server in info.servers.items()}
    assert list(budgets.values()) == [2 * tokens_per_block * LATENT_BYTES] * 2
