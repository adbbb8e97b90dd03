"""petals-mistral passes the conformance kit on each of its model types, with what makes each differ
switched on: Mistral's sliding window on every layer; Ministral 3's yarn rope and queries scaled by
position (``llama_4_scaling_beta``)."""

import pytest
from transformers import Ministral3Config, MistralConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, SlidingWindowSpec
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
WINDOW = 6
# yarn over an original context of 4 positions, and a query scale that grows every 4 positions: both
# take effect within the kit's few steps
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=4,
    beta_fast=32.0,
    beta_slow=1.0,
    llama_4_scaling_beta=0.5,
)
CONFIGS = {
    "mistral": MistralConfig(**TINY, sliding_window=WINDOW),
    "ministral3": Ministral3Config(**TINY, max_position_embeddings=16, rope_parameters=YARN),
}
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = {  # what each block caches, as servers budget it
    "mistral": [SlidingWindowSpec(**HEADS, window=WINDOW)] * 4,
    "ministral3": [FullAttentionSpec(**HEADS)] * 4,
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_mistral_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert [type(spec) for spec in report.cache_specs] == [type(spec) for spec in SPECS[model_type]]
    config = get_plugin_manager().family(model_type).config_class.from_dict(CONFIGS[model_type].to_dict())
    assert [cache_spec(config, index) for index in range(4)] == SPECS[model_type]


def test_mistral_prefix_rule():
    check_prefix_rules({"mistralai/Mistral-7B-v0.1": "Mistral-7B-v0-1"}, CONFIGS["mistral"])
