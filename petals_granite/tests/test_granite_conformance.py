"""petals-granite passes the conformance kit on each of its model types, with Granite's four
multipliers set away from 1: ``attention_multiplier`` and ``residual_multiplier`` live in the layer
(the servers' blocks), ``embedding_multiplier`` and ``logits_scaling`` in the model around them (the
client's transformers model applies them, so the kit compares logits, not hidden states)."""

import pytest
from transformers import GraniteConfig, GraniteMoeConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family

# 4 query heads and 2 key/value heads of 16 values; multipliers of the real 3.x models' magnitudes
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    embedding_multiplier=12.0,
    logits_scaling=8.0,
    residual_multiplier=0.22,
    attention_multiplier=0.0078125,
)
CONFIGS = {
    "granitemoe": GraniteMoeConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    "granite": GraniteConfig(**TINY),
}
FULL = [FullAttentionSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)] * 4


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_granite_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    config = get_plugin_manager().family(model_type).config_class.from_dict(CONFIGS[model_type].to_dict())
    assert [cache_spec(config, index) for index in range(4)] == FULL
