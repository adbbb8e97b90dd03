"""petals-deepseek passes the conformance kit: layers that differ by index (dense first, then shared and
routed experts with group-limited routing), and a cache that holds the latent, not expanded heads."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

# 4 query heads of 8 + 8 key and 12 value values; the latent is 16 values and the rope key 8
TINY = dict(
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
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
CONFIGS = {
    "deepseek_v3": DeepseekV3Config(**TINY, n_group=2, topk_group=1),
    "deepseek_v2": DeepseekV2Config(**TINY, n_group=2, topk_group=1, topk_method="group_limited_greedy"),
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_deepseek_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    latent = FullAttentionSpec(num_kv_heads=1, key_dim=16, value_dim=8, num_query_heads=4)
    assert report.cache_specs == [latent] * 4
    assert latent.bytes_per_token(torch.float32) == (16 + 8) * 4  # not 4 heads x (16 + 12) values


def test_the_first_layers_are_dense_and_the_others_experts():
    config = (
        get_plugin_manager().family("deepseek_v3").config_class.from_dict(CONFIGS["deepseek_v3"].to_dict())
    )
    mlps = [type(config.block_class(config, index).mlp).__name__ for index in range(4)]
    assert mlps == ["DeepseekV3MLP"] + ["DeepseekV3MoE"] * 3


def test_real_model_caches_576_values_per_token():
    """DeepSeek V3's published sizes: the latent is 512 + 64 values, not 128 heads x (192 + 128)."""
    config = get_plugin_manager().family("deepseek_v3").config_class()  # DeepSeek V3's own defaults
    spec = cache_spec(config, 5)
    assert (config.num_attention_heads, config.qk_head_dim, config.v_head_dim) == (128, 192, 128)
    assert spec.bytes_per_token(torch.bfloat16) == 576 * 2


def test_deepseek_prefix_rule():
    check_prefix_rules({"deepseek-ai/DeepSeek-V3.1": "DeepSeek-V3-1"}, CONFIGS["deepseek_v3"])
