"""petals-phi passes the conformance kit on each of its model types, with what makes each differ
switched on: Phi-3.5-MoE's routed experts (sparsemixer routing), attention biases and LM-head bias,
with a sliding window on every layer; Phi-3's fused projections and partial rotary, sliding too."""

import pytest
from transformers import Phi3Config, PhimoeConfig

from petals.block import cache_spec
from petals.kv_cache import SlidingWindowSpec
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
    pad_token_id=0,
)
WINDOW = 6
CONFIGS = {
    "phimoe": PhimoeConfig(
        **TINY,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        attention_bias=True,
        lm_head_bias=True,
    ),
    "phi3": Phi3Config(
        **TINY, sliding_window=WINDOW, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}
    ),
}
SLIDING = [SlidingWindowSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4, window=WINDOW)] * 4


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_phi_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    config = get_plugin_manager().family(model_type).config_class.from_dict(CONFIGS[model_type].to_dict())
    assert [cache_spec(config, index) for index in range(4)] == SLIDING
