"""petals-qwen passes the conformance kit on each of its model types, with what makes each differ
switched on: Qwen3-Next's gated delta net layers (a fixed-size state per sequence) between full-attention
ones, and routed experts with a gated shared expert; the same layers in Qwen3.5 (dense MLP, partial
multimodal rotary) and Qwen3.5 MoE; Qwen3 MoE's dense layers among expert ones; Qwen2
MoE's shared expert and sliding layers; Qwen3's sliding layers."""

import pytest
import torch
from transformers import (
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, LinearAttentionSpec, SlidingWindowSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

# 4 query heads and 2 key/value heads of 16 values
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
WINDOW = 6
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"] * 2
# as the real models: three linear attention layers, then a full one
LINEAR = dict(
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
CONFIGS = {
    "qwen3_next": Qwen3NextConfig(**TINY, **EXPERTS, **LINEAR, shared_expert_intermediate_size=32),
    "qwen3_5_text": Qwen3_5TextConfig(**TINY, **LINEAR),  # a quarter of each head rotates
    "qwen3_5_moe_text": Qwen3_5MoeTextConfig(**TINY, **EXPERTS, **LINEAR, shared_expert_intermediate_size=32),
    "qwen3_moe": Qwen3MoeConfig(**TINY, **EXPERTS, mlp_only_layers=[0]),
    "qwen2_moe": Qwen2MoeConfig(
        **TINY,
        **EXPERTS,
        shared_expert_intermediate_size=32,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=SLIDING_THEN_FULL,
    ),
    "qwen3": Qwen3Config(
        **TINY, use_sliding_window=True, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL
    ),
}
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SLIDING_AND_FULL = [SlidingWindowSpec(**HEADS, window=WINDOW), FullAttentionSpec(**HEADS)] * 2
# queries and keys of 2 heads x 8 and values of 4 heads x 8 in the convolution; a 8 x 8 state per value head
GATED_DELTA_NET = LinearAttentionSpec(conv_dim=2 * 16 + 32, conv_kernel=4, recurrent_shape=(4, 8, 8))
SPECS = {  # what each block caches, as servers budget it
    "qwen3_next": [GATED_DELTA_NET] * 3 + [FullAttentionSpec(**HEADS)],
    "qwen3_5_text": [GATED_DELTA_NET] * 3 + [FullAttentionSpec(**HEADS)],
    "qwen3_5_moe_text": [GATED_DELTA_NET] * 3 + [FullAttentionSpec(**HEADS)],
    "qwen3_moe": [FullAttentionSpec(**HEADS)] * 4,
    "qwen2_moe": SLIDING_AND_FULL,
    "qwen3": SLIDING_AND_FULL,
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_qwen_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert [type(spec) for spec in report.cache_specs] == [type(spec) for spec in SPECS[model_type]]
    config = distributed(model_type)
    assert [cache_spec(config, index) for index in range(4)] == SPECS[model_type]


def distributed(model_type: str):
    config = CONFIGS[model_type]
    return get_plugin_manager().family(model_type).config_class.from_dict(config.to_dict())


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_gated_delta_net_blocks_are_the_layers_of_their_index(model_type):
    config = distributed(model_type)
    blocks = [config.block_class(config, index) for index in range(4)]
    assert [block.layer_type for block in blocks] == ["linear_attention"] * 3 + ["full_attention"]
    assert [hasattr(block, "linear_attn") for block in blocks] == [True] * 3 + [False]
    has_experts = model_type != "qwen3_5_text"
    assert all(hasattr(block.mlp, "shared_expert") == has_experts for block in blocks)


def test_qwen3_moe_dense_layers_come_from_mlp_only_layers():
    config = distributed("qwen3_moe")
    mlps = [type(config.block_class(config, index).mlp).__name__ for index in range(4)]
    assert mlps == ["Qwen3MoeMLP"] + ["Qwen3MoeSparseMoeBlock"] * 3


def test_real_qwen3_next_keeps_one_state_per_sequence_however_long():
    """Qwen3-Next-80B-A3B's own sizes: 3 of 4 layers hold a fixed state, the 4th 2 heads of 256 per token."""
    config = get_plugin_manager().family("qwen3_next").config_class()  # the 80B-A3B defaults
    linear, full = cache_spec(config, 0), cache_spec(config, 3)
    assert isinstance(linear, LinearAttentionSpec) and linear.tokens_held(100_000) == 0
    # 16 key heads x 128 (queries and keys) + 32 value heads x 128, over 4 steps; 32 x 128 x 128 float32
    assert linear.state_bytes(torch.bfloat16) == (2 * 16 + 32) * 128 * 4 * 2 + 32 * 128 * 128 * 4
    assert full == FullAttentionSpec(num_kv_heads=2, key_dim=256, value_dim=256, num_query_heads=16)


def test_qwen_prefix_rule():
    check_prefix_rules(
        {"Qwen/Qwen3-Next-80B-A3B-Instruct": "Qwen3-Next-80B-A3B-Instruct"}, CONFIGS["qwen3_next"]
    )
    check_prefix_rules({"Qwen/Qwen3-0.6B": "Qwen3-0-6B"}, CONFIGS["qwen3"])
