"""petals-olmo passes the conformance kit on each of its model types, with what makes each differ
switched on: OLMo 3's sliding layers among full-attention ones, OLMoE's routed experts with q/k
norms and clipped q/k/v, OLMo 2's q/k norms over all heads and norms after each sublayer."""

import pytest
from transformers import Olmo2Config, Olmo3Config, OlmoeConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, SlidingWindowSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family

# 4 query heads and 2 key/value heads of 16 values
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
WINDOW = 6
CONFIGS = {
    # as the real model: three sliding layers, then a full one
    "olmo3": Olmo3Config(
        **TINY, sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"]
    ),
    "olmoe": OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, clip_qkv=8.0),
    "olmo2": Olmo2Config(**TINY),
}
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = {  # what each block caches, as servers budget it
    "olmo3": [SlidingWindowSpec(**HEADS, window=WINDOW)] * 3 + [FullAttentionSpec(**HEADS)],
    "olmoe": [FullAttentionSpec(**HEADS)] * 4,
    "olmo2": [FullAttentionSpec(**HEADS)] * 4,
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_olmo_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert [type(spec) for spec in report.cache_specs] == [type(spec) for spec in SPECS[model_type]]
    config = get_plugin_manager().family(model_type).config_class.from_dict(CONFIGS[model_type].to_dict())
    assert [cache_spec(config, index) for index in range(4)] == SPECS[model_type]
