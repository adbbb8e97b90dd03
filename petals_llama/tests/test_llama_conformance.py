"""petals-llama passes the conformance kit on Llama 4 (text) and SmolLM3, with what makes each differ
switched on: Llama 4's chunked attention on its rope layers and full attention on the no-rope one, experts
with a shared expert every other layer and dense MLPs between; SmolLM3's no-rope layer. (Llama itself
is the kit's own subject in ``tests/test_conformance.py``.)"""

import pytest
from transformers import Llama4TextConfig, LlamaConfig, SmolLM3Config

from petals.block import cache_spec
from petals.kv_cache import ChunkedAttentionSpec, FullAttentionSpec
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
CHUNK = 6
CONFIGS = {
    # as the real model: three chunked rope layers, then a full no-rope one
    "llama4_text": Llama4TextConfig(
        **TINY,
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=CHUNK,
        no_rope_layers=[1, 1, 1, 0],
    ),
    "smollm3": SmolLM3Config(**TINY, no_rope_layers=[1, 1, 1, 0], pad_token_id=0),
}
HEADS = dict(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4)
SPECS = {  # what each block caches, as servers budget it
    "llama4_text": [ChunkedAttentionSpec(**HEADS, window=CHUNK)] * 3 + [FullAttentionSpec(**HEADS)],
    "smollm3": [FullAttentionSpec(**HEADS)] * 4,
}


def distributed(model_type: str):
    config = CONFIGS[model_type]
    return get_plugin_manager().family(model_type).config_class.from_dict(config.to_dict())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_llama_family_conforms(model_type, tmp_path):
    report = check_family(CONFIGS[model_type], tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert [type(spec) for spec in report.cache_specs] == [type(spec) for spec in SPECS[model_type]]
    assert [cache_spec(distributed(model_type), index) for index in range(4)] == SPECS[model_type]


def test_llama4_blocks_are_the_layers_of_their_index():
    config = distributed("llama4_text")
    blocks = [config.block_class(config, index) for index in range(4)]
    assert [block.is_moe_layer for block in blocks] == [False, True, False, True]
    assert [block.self_attn.use_rope for block in blocks] == [True, True, True, False]


def test_smollm3_blocks_skip_rope_where_no_rope_layers_says():
    config = distributed("smollm3")
    assert [config.block_class(config, index).self_attn.use_rope for index in range(4)] == [1, 1, 1, 0]


def test_only_llama_keeps_the_original_petals_suffix():
    check_prefix_rules({"meta-llama/Llama-4-Scout-17B-16E": "Llama-4-Scout-17B-16E"}, CONFIGS["llama4_text"])
    check_prefix_rules({"HuggingFaceTB/SmolLM3-3B": "SmolLM3-3B"}, CONFIGS["smollm3"])
    check_prefix_rules({"meta-llama/Llama-2-7b": "Llama-2-7b-hf"}, LlamaConfig(**TINY))
