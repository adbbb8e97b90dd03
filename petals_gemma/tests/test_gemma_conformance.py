"""petals-gemma passes the conformance kit on each of its model types, with what makes each differ
switched on: Gemma 4's full layers with wider heads and fewer key/value heads than its sliding ones (keys
doubling as values), experts beside the MLP; Gemma 3's sliding layers (a local rotary base) before a full
one; Gemma 2's sliding and full layers in turn, with soft-capped attention scores; Gemma's multi-query
attention. And Gemma 4's last layers that reuse earlier layers' keys and values, caching nothing."""

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, Gemma4TextConfig, GemmaConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, SharedKVSpec, SlidingWindowSpec, closed_boundaries
from petals.plugins import get_plugin_manager
from petals.testing import StepSchedule, check_family, check_prefix_rules

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
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"] * 2
# full layers: one key/value head of 32 values (keys are the values); per-layer embeddings off, as
# petals serves Gemma 4
GEMMA4 = dict(
    sliding_window=WINDOW,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    final_logit_softcapping=3.0,
    hidden_size_per_layer_input=0,
)
CONFIGS = {
    "gemma": GemmaConfig(**{**TINY, "num_key_value_heads": 1}),
    # soft-capping as large as the real model's would leave a tiny model's scores uncapped
    "gemma2": Gemma2Config(
        **TINY,
        sliding_window=WINDOW,
        layer_types=SLIDING_THEN_FULL,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3_text": Gemma3TextConfig(
        **TINY, sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"]
    ),
    "gemma4_text": Gemma4TextConfig(**TINY, layer_types=SLIDING_THEN_FULL, **GEMMA4),
}
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = {  # what each block caches, as servers budget it
    "gemma": [FullAttentionSpec(**{**HEADS, "num_kv_heads": 1})] * 4,
    "gemma2": [SlidingWindowSpec(**HEADS, window=WINDOW), FullAttentionSpec(**HEADS)] * 2,
    "gemma3_text": [SlidingWindowSpec(**HEADS, window=WINDOW)] * 3 + [FullAttentionSpec(**HEADS)],
    "gemma4_text": [
        SlidingWindowSpec(**HEADS, window=WINDOW),
        FullAttentionSpec(num_kv_heads=1, key_dim=32, value_dim=32, num_query_heads=4),
    ]
    * 2,
}
EXACT = 1e-5
# Gemma 4 scales no attention score by 1 / sqrt(head_dim) (its queries and keys are RMS-normalised
# instead), so its scores, and the float32 rounding a merged batch's padded keys and explicit mask change,
# are larger: merged sessions differ from solo runs by up to ~1.4e-5. Its blocks still equal transformers
# within EXACT (checked below on the report)
MERGED = {"gemma4_text": 5e-5}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_gemma_conforms(model_type, tmp_path):
    schedule = StepSchedule(atol=MERGED.get(model_type, EXACT))
    report = check_family(CONFIGS[model_type], tmp_path, schedule=schedule)
    assert max(report.max_abs_diff.values()) <= EXACT
    assert [type(spec) for spec in report.cache_specs] == [type(spec) for spec in SPECS[model_type]]
    assert [cache_spec(distributed(model_type), index) for index in range(4)] == SPECS[model_type]


def distributed(model_type: str):
    config = CONFIGS[model_type]
    return get_plugin_manager().family(model_type).config_class.from_dict(config.to_dict())


def test_gemma2_blocks_cap_their_attention_scores():
    config = distributed("gemma2")
    blocks = [config.block_class(config, index) for index in range(4)]
    assert [block.self_attn.attn_logit_softcapping for block in blocks] == [2.0] * 4
    assert [block.self_attn.sliding_window for block in blocks] == [WINDOW, None] * 2


# Gemma 4's last layers reusing the keys and values of the last earlier layer of their type (layers 4
# and 5 those of 2 and 3); transformers 5.24's model fails to run such a config without per-layer
# embeddings (it slices per_layer_inputs, None then) unless asked for its hidden states
SHARING = Gemma4TextConfig(
    **{**TINY, "num_hidden_layers": 6},
    layer_types=["sliding_attention", "full_attention"] * 3,
    num_kv_shared_layers=2,
    output_hidden_states=True,
    **GEMMA4,
)


def test_gemma4_layers_reusing_keys_and_values_conform_and_cache_nothing(tmp_path):
    report = check_family(SHARING, tmp_path, schedule=StepSchedule(atol=MERGED["gemma4_text"]))
    assert max(report.max_abs_diff.values()) <= EXACT
    sliding, full = SPECS["gemma4_text"][:2]
    assert report.cache_specs[4:] == [SharedKVSpec(2, sliding), SharedKVSpec(3, full)]
    assert [spec.bytes_per_token(torch.float32) for spec in report.cache_specs[4:]] == [0, 0]
    assert closed_boundaries(report.cache_specs) == {3, 4, 5}  # blocks 2:6 run in one pass


def test_gemma4_refuses_what_servers_cannot_split_in_one_line(tmp_path):
    field, value = "hidden_size_per_layer_input", 256
    from petals.auto import AutoDistributedConfig
    from petals.plugins import PluginError

    Gemma4TextConfig(**{**CONFIGS["gemma4_text"].to_dict(), field: value}).save_pretrained(tmp_path)
    with pytest.raises(PluginError) as refused:
        AutoDistributedConfig.from_pretrained(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{field}={value}" in message and f"with {field}=0" in message


def test_gemma_prefix_rule():
    check_prefix_rules({"google/gemma-3-1b-it": "gemma-3-1b-it"}, CONFIGS["gemma3_text"])
    check_prefix_rules({"google/gemma-2-2b": "gemma-2-2b"}, CONFIGS["gemma2"])
