"""petals-gpt-oss passes the conformance kit with what makes GPT-OSS differ switched on: a learned
attention sink per head (hence eager attention, as transformers picks for the full model), sliding and
full layers in turn, routed experts."""

from transformers import GptOssConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, SlidingWindowSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules

WINDOW = 6
CONFIG = GptOssConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
)
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = [SlidingWindowSpec(**HEADS, window=WINDOW), FullAttentionSpec(**HEADS)] * 2


def distributed():
    return get_plugin_manager().family("gpt_oss").config_class.from_dict(CONFIG.to_dict())


def test_gpt_oss_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert [type(spec) for spec in report.cache_specs] == [type(spec) for spec in SPECS]
    assert [cache_spec(distributed(), index) for index in range(4)] == SPECS


def test_gpt_oss_blocks_attend_eagerly_to_their_sinks():
    config = distributed()
    block = config.block_class(config, 0)
    assert block.self_attn.config._attn_implementation == "eager"
    assert block.self_attn.sinks.shape == (4,)


def test_gpt_oss_prefix_rule():
    check_prefix_rules({"openai/gpt-oss-20b": "gpt-oss-20b"}, CONFIG)
