"""petals-glm serves GLM-5 (``glm_moe_dsa``): latent attention over the tokens a sparse-attention indexer
picks, its latent, rope key and indexer keys paged per token (``IndexedAttentionSpec``), exactly as
transformers computes it; configs whose layers share an earlier layer's indexer selection are refused."""

import subprocess
import sys

import pytest
import torch
from transformers import GlmMoeDsaConfig

from petals.auto import AutoDistributedConfig
from petals.block import cache_spec
from petals.kv_cache import IndexedAttentionSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family

# a dense first layer, then shared and routed experts; the indexer keeps 4 of up to 20 tokens per query,
# so it really chooses. 8 indexer heads: with 2, ReLU zeroes many tokens' scores and top-k then breaks
# ties by column, which differs between a session alone and left-padded beside a longer one
TINY = GlmMoeDsaConfig(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
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
    pad_token_id=0,
)
LATENT = IndexedAttentionSpec(num_kv_heads=1, key_dim=16, value_dim=8, num_query_heads=4, index_dim=16)


def distributed(config: GlmMoeDsaConfig):
    return get_plugin_manager().family("glm_moe_dsa").config_class.from_dict(config.to_dict())


def test_glm_moe_dsa_conforms(tmp_path):
    report = check_family(TINY, tmp_path)
    assert report.cache_specs == [LATENT] * 4
    assert max(report.max_abs_diff.values()) <= 1e-5 and report.merged_sessions_diff <= 1e-5


def test_glm5_caches_its_latent_and_indexer_keys_46x_less_than_expanded_heads():
    config = distributed(GlmMoeDsaConfig())  # GLM-5's published sizes are the defaults
    spec = cache_spec(config, 0)
    kept = spec.bytes_per_token(torch.bfloat16) // 2
    expanded = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    assert (kept, expanded) == (512 + 64 + 128, 64 * (256 + 256)) == (704, 32_768)
    assert round(expanded / kept, 1) == 46.5


def test_layers_sharing_an_earlier_indexer_selection_are_refused_in_one_line(tmp_path):
    shared = GlmMoeDsaConfig(**{**TINY.to_dict(), "indexer_types": ["full", "shared", "full", "shared"]})
    shared.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"^glm_moe_dsa layers \[1, 3\] reuse an earlier layer's indexer"
    ) as error:
        AutoDistributedConfig.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)
    # petals serve stops at the config with that line alone
    serve = "from petals.cli import main; main(prog_name='petals')"
    args = ["serve", str(tmp_path), "--loopback", "--new_swarm", "--torch_dtype", "float32"]
    result = subprocess.run([sys.executable, "-c", serve, *args], capture_output=True, text=True, timeout=240)
    assert result.returncode == 1 and result.stderr.strip() == f"Error: {error.value}", result.stderr
