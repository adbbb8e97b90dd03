"""The plugin contract serves the families of 2025-2026 in the documented three-line form.

Each case is a throwaway plugin written as ``plugins/README.md`` documents the minimal one (the HF
config with ``DistributedConfigMixin`` in front, ``class XBlock(RotaryBlockMixin, XDecoderLayer):
rotary_class = XRotaryEmbedding``, ``block_prefix = "model.layers"``, ``attn_class``), run through the
conformance kit on a tiny config that switches on what makes the family differ: layers that differ
by index (first dense layers, experts from a start index or every other layer, no-rope layers),
sliding and chunked windows, rotary embeddings per layer type, attention sinks (eager attention),
linear attention (a fixed-size state per sequence) between full-attention layers, experts every
other layer.
DeepSeek V3 adds one hook: its layers cache the latent (``kv_lora_rank`` + ``qk_rope_head_dim``
values per token), which its ``cache_spec`` describes.
"""

import importlib

import pytest
import torch
import transformers

from petals import hookimpl
from petals.block import RotaryBlockMixin
from petals.config import DistributedConfigMixin
from petals.kv_cache import (
    ChunkedAttentionSpec,
    FullAttentionSpec,
    LinearAttentionSpec,
    LinearAttentionState,
    SlidingWindowSpec,
)
from petals.plugins import PluginManager, using_plugin_manager
from petals.testing.conformance import check_family

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "num_hidden_layers": 4,
}
MOSTLY_SLIDING = ["sliding_attention"] * 3 + ["full_attention"]
MOSTLY_LINEAR = ["linear_attention"] * 3 + ["full_attention"]


def three_line_plugin(config, module: str, layer: str, rotary: str, attention: str | None):
    """The documented minimal plugin for ``config``'s model type, built from transformers' own classes."""
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    block = type(
        layer, (RotaryBlockMixin, getattr(modeling, layer)), {"rotary_class": getattr(modeling, rotary)}
    )
    config_class = type(
        f"Distributed{type(config).__name__}",
        (DistributedConfigMixin, type(config)),
        {
            "block_class": block,
            "block_prefix": "model.layers",
            "attn_class": getattr(modeling, attention) if attention else None,
        },
    )

    class Plugin:
        @hookimpl
        def register_model_families(self, register):
            register(config_class)

    return Plugin


class LatentCache:
    """DeepSeek's one hook: its attention caches the compressed latent and the shared rope key."""

    @hookimpl
    def cache_spec(self, config):
        return FullAttentionSpec(
            num_kv_heads=1,
            key_dim=config.kv_lora_rank,
            value_dim=config.qk_rope_head_dim,
            num_query_heads=config.num_attention_heads,
        )


T = transformers
CASES = {
    "deepseek_v3": (
        T.DeepseekV3Config(
            **{**SMALL, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        ),
        ("deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3RotaryEmbedding", None),
    ),
    "glm4_moe": (
        T.Glm4MoeConfig(
            **SMALL, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        ),
        ("glm4_moe", "Glm4MoeDecoderLayer", "Glm4MoeRotaryEmbedding", "Glm4MoeAttention"),
    ),
    "ernie4_5_moe": (
        T.Ernie4_5_MoeConfig(
            **SMALL, moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_layer_start_index=1,
            moe_num_shared_experts=1,
        ),
        ("ernie4_5_moe", "Ernie4_5_MoeDecoderLayer", "Ernie4_5_MoeRotaryEmbedding", "Ernie4_5_MoeAttention"),
    ),
    "llama4_text": (
        T.Llama4TextConfig(
            **SMALL, head_dim=16, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=6, no_rope_layers=[1, 1, 1, 0],
        ),
        ("llama4", "Llama4TextDecoderLayer", "Llama4TextRotaryEmbedding", "Llama4TextAttention"),
    ),
    "smollm3": (
        T.SmolLM3Config(**SMALL, no_rope_layers=[1, 1, 1, 0], pad_token_id=0),
        ("smollm3", "SmolLM3DecoderLayer", "SmolLM3RotaryEmbedding", "SmolLM3Attention"),
    ),
    "gemma3_text": (
        T.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=6, layer_types=MOSTLY_SLIDING),
        ("gemma3", "Gemma3DecoderLayer", "Gemma3RotaryEmbedding", "Gemma3Attention"),
    ),
    "olmo3": (
        T.Olmo3Config(**SMALL, sliding_window=6, layer_types=MOSTLY_SLIDING),
        ("olmo3", "Olmo3DecoderLayer", "Olmo3RotaryEmbedding", "Olmo3Attention"),
    ),
    "gpt_oss": (
        T.GptOssConfig(
            **SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        ("gpt_oss", "GptOssDecoderLayer", "GptOssRotaryEmbedding", "GptOssAttention"),
    ),
    "mistral": (
        T.MistralConfig(**SMALL, sliding_window=6),
        ("mistral", "MistralDecoderLayer", "MistralRotaryEmbedding", "MistralAttention"),
    ),
    "qwen3_next": (
        T.Qwen3NextConfig(
            **SMALL, head_dim=16, layer_types=MOSTLY_LINEAR, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            decoder_sparse_step=2,
        ),
        ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRotaryEmbedding", "Qwen3NextAttention"),
    ),
}  # fmt: skip
KINDS = {
    "llama4_text": [ChunkedAttentionSpec] * 3 + [FullAttentionSpec],
    "gemma3_text": [SlidingWindowSpec] * 3 + [FullAttentionSpec],
    "olmo3": [SlidingWindowSpec] * 3 + [FullAttentionSpec],
    "gpt_oss": [SlidingWindowSpec, FullAttentionSpec] * 2,
    "mistral": [SlidingWindowSpec] * 4,
    "qwen3_next": [LinearAttentionSpec] * 3 + [FullAttentionSpec],
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_family_in_the_three_line_form_passes_the_kit(model_type, tmp_path):
    config, classes = CASES[model_type]
    plugin = three_line_plugin(config, *classes)
    if model_type == "deepseek_v3":
        plugin.cache_spec = LatentCache.cache_spec
    manager = PluginManager()
    manager.register(plugin(), name=f"three-line-{model_type}")
    with using_plugin_manager(manager):
        report = check_family(config, tmp_path)
    kinds = [type(spec) for spec in report.cache_specs]
    assert kinds == KINDS.get(model_type, [FullAttentionSpec] * 4)
    if model_type == "deepseek_v3":  # 16 + 8 values per token, not 4 heads × (16 + 12)
        assert report.cache_specs[0].bytes_per_token(torch.float32) == (16 + 8) * 4


def test_gpt_oss_blocks_run_the_eager_attention_transformers_picks_for_it(tmp_path):
    """sdpa would ignore GPT-OSS's attention sinks: the kit fails such a block, naming both implementations."""
    config, classes = CASES["gpt_oss"]
    plugin = three_line_plugin(config, *classes)
    manager = PluginManager()
    manager.register(plugin(), name="gpt-oss-sdpa")
    with using_plugin_manager(manager):
        family = manager.family("gpt_oss")
        family.config_class.block_class.attn_implementation = "sdpa"
        with pytest.raises(
            AssertionError, match="blocks: attention sdpa.*transformers' model: attention eager"
        ):
            check_family(config, tmp_path)


def test_the_kit_catches_a_linear_state_that_rewinds_without_restoring(tmp_path, monkeypatch):
    """A fixed-size state cannot be truncated: moving its position back alone computes wrong tokens."""
    config, classes = CASES["qwen3_next"]
    manager = PluginManager()
    manager.register(three_line_plugin(config, *classes)(), name="qwen3-next-forgetful-rewind")
    monkeypatch.setattr(
        LinearAttentionState, "rewind", lambda state, position: setattr(state, "length", position)
    )
    with using_plugin_manager(manager):
        with pytest.raises(AssertionError, match="qwen3_next step replayed after rewind: max"):
            check_family(config, tmp_path)
