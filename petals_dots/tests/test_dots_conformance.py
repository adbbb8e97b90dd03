"""petals-dots passes the conformance kit on dots.llm1 (``dots1``) with what makes it differ switched
on: a dense first layer (``first_k_dense_replace``), then a shared expert and routed experts chosen
by group (``n_group``, sigmoid scores, a routed scaling factor); per-head q/k norms; and sliding
layers from ``max_window_layers`` on (a window shorter than the kit's sessions)."""

from transformers import Dots1Config

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, SlidingWindowSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

WINDOW = 6
# 4 query heads and 2 key/value heads of 16 values
CONFIG = Dots1Config(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    sliding_window=WINDOW,
    max_window_layers=2,
)
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = [FullAttentionSpec(**HEADS)] * 2 + [SlidingWindowSpec(**HEADS, window=WINDOW)] * 2


def distributed():
    return get_plugin_manager().family("dots1").config_class.from_dict(CONFIG.to_dict())


def test_dots1_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert [cache_spec(distributed(), index) for index in range(4)] == SPECS


def test_dots1_dense_layers_come_from_first_k_dense_replace():
    config = distributed()
    mlps = [type(config.block_class(config, index).mlp).__name__ for index in range(4)]
    assert mlps == ["Dots1MLP"] + ["Dots1MoE"] * 3


def test_dots_prefix_rule():
    check_prefix_rules({"rednote-hilab/dots.llm1.inst": "dots-llm1-inst"}, CONFIG)
