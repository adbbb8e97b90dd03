"""petals-ernie passes the conformance kit on ERNIE 4.5 MoE (``ernie4_5_moe``) with what makes it
differ switched on: a dense layer before ``moe_layer_start_index`` and after ``moe_layer_end_index``
around layers of routed experts with a shared expert, and biases in attention and MLPs."""

from transformers import Ernie4_5_MoeConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

# 4 query heads and 2 key/value heads of 16 values; experts on layers 1 and 2 only
CONFIG = Ernie4_5_MoeConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    use_bias=True,
    moe_num_experts=4,
    moe_k=2,
    moe_intermediate_size=32,
    moe_num_shared_experts=1,
    moe_layer_start_index=1,
    moe_layer_end_index=2,
)


def distributed():
    return get_plugin_manager().family("ernie4_5_moe").config_class.from_dict(CONFIG.to_dict())


def test_ernie4_5_moe_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    full = FullAttentionSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
    assert [cache_spec(distributed(), index) for index in range(4)] == [full] * 4


def test_ernie4_5_moe_layers_differ_by_index():
    config = distributed()
    mlps = [type(config.block_class(config, index).mlp).__name__ for index in range(4)]
    assert mlps == [
        "Ernie4_5_MoeMLP",
        "Ernie4_5_MoeSparseMoeBlock",
        "Ernie4_5_MoeSparseMoeBlock",
        "Ernie4_5_MoeMLP",
    ]
    assert config.block_class(config, 1).mlp.shared_experts is not None


def test_ernie_prefix_rule():
    check_prefix_rules({"baidu/ERNIE-4.5-21B-A3B-PT": "ERNIE-4-5-21B-A3B-PT"}, CONFIG)
