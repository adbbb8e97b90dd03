"""petals-exaone passes the conformance kit on EXAONE 4.0 (``exaone4``) with what makes it differ
switched on: sliding layers (a window shorter than the kit's sessions) that rotate, between
full-attention layers without positions; per-head q/k norms; norms after attention and the MLP."""

from transformers import Exaone4Config

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, SlidingWindowSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

WINDOW = 6
# every second layer full (the real models: every fourth); 4 query heads and 2 key/value heads of 16
CONFIG = Exaone4Config(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    sliding_window=WINDOW,
    sliding_window_pattern=2,
)
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = [SlidingWindowSpec(**HEADS, window=WINDOW), FullAttentionSpec(**HEADS)] * 2


def test_exaone4_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    config = get_plugin_manager().family("exaone4").config_class.from_dict(CONFIG.to_dict())
    assert [cache_spec(config, index) for index in range(4)] == SPECS


def test_exaone_prefix_rule():
    check_prefix_rules({"LGAI-EXAONE/EXAONE-4.0-32B": "EXAONE-4-0-32B"}, CONFIG)
