"""petals-glm passes the conformance kit on each of its model types, with what makes each differ
switched on: GLM-4.5/4.6's dense first layer (``first_k_dense_replace``) before layers of routed
experts with a shared expert and group-limited routing (``n_group``), and q/k norms; GLM-4's q/k/v
biases and half-rotary heads with norms after attention and after the MLP."""

import pytest
from transformers import Glm4Config, Glm4MoeConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family

# 4 query heads and 2 key/value heads of 16 values
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    pad_token_id=0,
)
CONFIGS = {
    "glm4_moe": Glm4MoeConfig(
        **TINY,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
    ),
    "glm4": Glm4Config(**TINY, attention_bias=True),
}
FULL = [FullAttentionSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)] * 4


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_glm_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert [cache_spec(distributed(model_type), index) for index in range(4)] == FULL


def distributed(model_type: str):
    config = CONFIGS[model_type]
    return get_plugin_manager().family(model_type).config_class.from_dict(config.to_dict())


def test_glm4_moe_dense_layers_come_from_first_k_dense_replace():
    config = distributed("glm4_moe")
    mlps = [type(config.block_class(config, index).mlp).__name__ for index in range(4)]
    assert mlps == ["Glm4MoeMLP"] + ["Glm4MoeMoE"] * 3
