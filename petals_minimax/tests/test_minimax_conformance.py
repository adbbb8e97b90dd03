"""petals-minimax passes the conformance kit on MiniMax-M2 (``minimax_m2``) with what makes it differ
switched on: partial rotary (``rotary_dim``, as released checkpoints state it), q/k norms over all
heads at once, and routed experts on every layer (sigmoid scores)."""

from transformers import MiniMaxM2Config

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
)
# 4 query heads and 2 key/value heads of 16 values, half of each rotating
CONFIG = MiniMaxM2Config(
    **TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8
)


def test_minimax_m2_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    config = get_plugin_manager().family("minimax_m2").config_class.from_dict(CONFIG.to_dict())
    full = FullAttentionSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
    assert [cache_spec(config, index) for index in range(4)] == [full] * 4
    assert config.rope_parameters["partial_rotary_factor"] == 0.5


def test_minimax_prefix_rule():
    check_prefix_rules({"MiniMaxAI/MiniMax-M2": "MiniMax-M2"}, CONFIG)
