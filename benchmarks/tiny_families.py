"""A tiny config for every model type the installed plugins register, for the checks that serve every
family (``benchmarks.gpu``'s correctness section).

Each has 4 layers of width 64 and a 1,000-token vocabulary, with what makes its family differ switched
on, as the plugin's own conformance tests build it: windows and chunks of 6 tokens (shorter than a short
generation), experts, latent and indexed caches, linear-attention states, hybrid layers. The configs
live here rather than in the plugins because the plugins' tests are not installed with them;
tests/test_tiny_families.py fails when a registered model type has neither a config nor a reason in
``LEFT_OUT``, so a new plugin cannot slip past the GPU check.
"""

from __future__ import annotations

import transformers
from transformers import PretrainedConfig

from petals.kv_cache import CacheSpec

WINDOW = 6
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TOKENS = dict(vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HEADS_OF_16 = dict(TINY, head_dim=16)
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"] * 2
MOSTLY_SLIDING = ["sliding_attention"] * 3 + ["full_attention"]
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LOCAL_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
# DeepSeek-style multi-head latent attention: a 16-value latent and an 8-value rope key per token
LATENT = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
ROUTED = dict(
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
GATED_DELTA_NET = dict(
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)

# model type -> (transformers' config class, its arguments, what the config switches on)
CONFIGS: dict[str, tuple[str, dict, str]] = {
    "llama": ("LlamaConfig", TINY, "grouped-query attention"),
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            HEADS_OF_16,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=WINDOW,
            no_rope_layers=[1, 1, 1, 0],
        ),
        "chunked rope layers, a full no-rope one, experts every other layer",
    ),
    "smollm3": ("SmolLM3Config", dict(HEADS_OF_16, no_rope_layers=[1, 1, 1, 0]), "a no-rope layer"),
    "bloom": (
        "BloomConfig",
        dict(TOKENS, hidden_size=64, n_layer=4, n_head=4),
        "ALiBi, fused query-key-value",
    ),
    "falcon": (
        "FalconConfig",
        dict(
            TOKENS,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            parallel_attn=True,
            alibi=False,
            bias=False,
        ),
        "the new decoder architecture: attention and MLP in parallel",
    ),
    "falcon_h1": (
        "FalconH1Config",
        dict(
            TINY,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=4,  # shorter than the prompt: the scan crosses chunks
            mamba_rms_norm=True,
            mlp_multipliers=[0.9, 1.1],
            ssm_multipliers=[1.0, 0.8, 1.2, 0.9, 1.1],
            key_multiplier=0.7,
            attention_in_multiplier=1.1,
            attention_out_multiplier=0.9,
            ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.8,
            embedding_multiplier=1.5,
            lm_head_multiplier=0.5,
        ),
        "Mamba2 beside attention in every layer",
    ),
    "mixtral": (
        "MixtralConfig",
        dict(TINY, **LOCAL_EXPERTS, sliding_window=WINDOW),
        "experts, a sliding window",
    ),
    "mistral": ("MistralConfig", dict(HEADS_OF_16, sliding_window=WINDOW), "a sliding window"),
    "ministral3": (
        "Ministral3Config",
        dict(
            HEADS_OF_16,
            max_position_embeddings=16,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=4,
                beta_fast=32.0,
                beta_slow=1.0,
                llama_4_scaling_beta=0.5,
            ),
        ),
        "yarn rope and a growing query scale",
    ),
    "qwen2": ("Qwen2Config", TINY, "the example plugin, plugins/petals_qwen2"),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            HEADS_OF_16,
            **EXPERTS,
            shared_expert_intermediate_size=32,
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
        ),
        "a shared expert, sliding layers",
    ),
    "qwen3": (
        "Qwen3Config",
        dict(HEADS_OF_16, use_sliding_window=True, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
        "sliding layers",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(HEADS_OF_16, **EXPERTS, mlp_only_layers=[0]),
        "a dense layer among experts",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(HEADS_OF_16, **EXPERTS, **GATED_DELTA_NET, shared_expert_intermediate_size=32),
        "gated delta net layers, a gated shared expert",
    ),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(HEADS_OF_16, **GATED_DELTA_NET), "gated delta net layers"),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        dict(HEADS_OF_16, **EXPERTS, **GATED_DELTA_NET, shared_expert_intermediate_size=32),
        "gated delta net layers, experts",
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(TINY, **LATENT, **ROUTED, n_group=2, topk_group=1, topk_method="group_limited_greedy"),
        "the latent cache of multi-head latent attention, grouped experts",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(TINY, **LATENT, **ROUTED, n_group=2, topk_group=1),
        "the latent cache of multi-head latent attention, grouped experts",
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            TINY,
            **LATENT,
            moe_intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            linear_num_heads=2,
            linear_head_dim=16,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        ),
        "delta attention states beside a latent-attention layer",
    ),
    "gemma": ("GemmaConfig", dict(HEADS_OF_16, num_key_value_heads=1), "multi-query attention"),
    "gemma2": (
        "Gemma2Config",
        dict(
            HEADS_OF_16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        "sliding layers, soft-capped scores and logits",
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(HEADS_OF_16, sliding_window=WINDOW, layer_types=MOSTLY_SLIDING),
        "sliding layers with their own rope",
    ),
    "gemma4_text": (
        "Gemma4TextConfig",
        dict(
            HEADS_OF_16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            final_logit_softcapping=3.0,
            hidden_size_per_layer_input=0,
        ),
        "sliding layers, full layers whose keys are their values, experts",
    ),
    "glm4": ("Glm4Config", dict(HEADS_OF_16, attention_bias=True), "attention biases, norms after each part"),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            HEADS_OF_16,
            **{**ROUTED, "n_routed_experts": 8},
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
        ),
        "grouped experts, query-key norms",
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        dict(
            TINY,
            **LATENT,
            **ROUTED,
            n_group=2,
            topk_group=1,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=8,
        ),
        "the indexed latent cache: a sparse-attention indexer keeps 4 tokens per query",
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(HEADS_OF_16, **LOCAL_EXPERTS, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
        "attention sinks, sliding layers, experts",
    ),
    "olmo2": ("Olmo2Config", TINY, "norms after attention and MLP"),
    "olmo3": ("Olmo3Config", dict(TINY, sliding_window=WINDOW, layer_types=MOSTLY_SLIDING), "sliding layers"),
    "olmoe": (
        "OlmoeConfig",
        dict(TINY, num_experts=4, num_experts_per_tok=2, clip_qkv=8.0),
        "experts, clipped q/k/v",
    ),
    "phi3": (
        "Phi3Config",
        dict(
            TINY,
            sliding_window=WINDOW,
            rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5},
        ),
        "partial rotary, a sliding window",
    ),
    "phimoe": (
        "PhimoeConfig",
        dict(TINY, **LOCAL_EXPERTS, sliding_window=WINDOW, attention_bias=True, lm_head_bias=True),
        "experts, a sliding window, biases",
    ),
    "granite": (
        "GraniteConfig",
        dict(
            TINY,
            embedding_multiplier=12.0,
            logits_scaling=8.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
        ),
        "embedding, residual, attention and logit multipliers",
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        dict(
            TINY,
            **LOCAL_EXPERTS,
            embedding_multiplier=12.0,
            logits_scaling=8.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
        ),
        "multipliers, experts",
    ),
    "cohere2": (
        "Cohere2Config",
        dict(TINY, sliding_window=WINDOW, layer_types=MOSTLY_SLIDING, logit_scale=0.25),
        "sliding layers, a full one without positions, scaled logits",
    ),
    "exaone4": (
        "Exaone4Config",
        dict(TINY, sliding_window=WINDOW, sliding_window_pattern=2),
        "sliding layers, q/k norms",
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        dict(
            TINY,
            use_bias=True,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
        ),
        "experts on the middle layers only",
    ),
    "dots1": (
        "Dots1Config",
        dict(
            TINY,
            **{**ROUTED, "n_routed_experts": 8},
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            sliding_window=WINDOW,
            max_window_layers=2,
        ),
        "grouped experts, sliding layers past max_window_layers",
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        dict(HEADS_OF_16, intermediate_size=32, **LOCAL_EXPERTS, rotary_dim=8),
        "partial rotary, sigmoid-scored experts",
    ),
    "lfm2": (
        "Lfm2Config",
        dict(
            TINY,
            block_auto_adjust_ff_dim=False,
            conv_L_cache=3,
            layer_types=["conv", "conv", "full_attention", "conv"],
        ),
        "short-convolution states beside attention",
    ),
}
# registered model types with no config here, and why
LEFT_OUT = {
    "petals_template": "the tutorial plugin (plugins/template): Mistral's code under a made-up name, which mistral covers",
}


def tiny_config(model_type: str) -> PretrainedConfig:
    """The tiny transformers config of ``model_type`` (a KeyError names the model types there are)."""
    if model_type not in CONFIGS:
        raise KeyError(
            f"no tiny config for model type {model_type!r}; there are: {', '.join(sorted(CONFIGS))}"
        )
    class_name, arguments, _ = CONFIGS[model_type]
    return getattr(transformers, class_name)(**arguments)


def cache_specs(config: PretrainedConfig) -> list[CacheSpec]:
    """What each block of ``config`` caches, as its plugin describes it to servers."""
    from petals.block import cache_spec
    from petals.plugins import get_plugin_manager

    distributed = get_plugin_manager().family(config.model_type).config_class.from_dict(config.to_dict())
    return [cache_spec(distributed, index) for index in range(distributed.num_hidden_layers)]


def cache_kinds(config: PretrainedConfig) -> list[str]:
    """The cache kinds of ``config``'s blocks as servers log them, each once, in block order."""
    return list(dict.fromkeys(spec.describe() for spec in cache_specs(config)))
