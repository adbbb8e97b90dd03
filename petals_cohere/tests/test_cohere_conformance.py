"""petals-cohere passes the conformance kit on Command R7B / Command A (``cohere2``) with what makes it
differ switched on: sliding layers (a window shorter than the kit's sessions, rotary on interleaved
pairs) before a full-attention layer without positions, attention and MLP in parallel on one layer
norm, and a logit scale in the head."""

from transformers import Cohere2Config

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, SlidingWindowSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

WINDOW = 6
# as the real models: three sliding layers, then a full one; 4 query heads and 2 key/value heads of 16
CONFIG = Cohere2Config(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    sliding_window=WINDOW,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    logit_scale=0.25,
)
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = [SlidingWindowSpec(**HEADS, window=WINDOW)] * 3 + [FullAttentionSpec(**HEADS)]


def test_cohere2_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    config = get_plugin_manager().family("cohere2").config_class.from_dict(CONFIG.to_dict())
    assert [cache_spec(config, index) for index in range(4)] == SPECS


def test_cohere_prefix_rule():
    check_prefix_rules({"CohereLabs/c4ai-command-r7b-12-2024": "c4ai-command-r7b-12-2024"}, CONFIG)
