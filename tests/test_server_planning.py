"""How a server decides what it runs with: how many blocks fit (weights after quantization, exact KV
cache, adapters, autograd reserve), its device, dtype, quantization, limits and throughput."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3_5TextConfig

from conftest import tiny_config
from petals.auto import AutoDistributedConfig
from petals.block import cache_spec
from petals.convert import estimate_block_weight_bytes
from petals.network.p2p import NetworkOptions
from petals.plugins import get_plugin_manager
from petals.server.planning import (
    GiB,
    choose_device,
    choose_dtype,
    choose_quant_type,
    default_limits,
    plan_num_blocks,
    resolve_settings,
)
from petals.server.settings import FULL_KV_LIMITS, GROUPED_KV_LIMITS, ServerSettings, SettingError
from petals.server.throughput import CACHE_FILE, ThroughputInfo, default_cache_dir, resolve_throughput


@pytest.fixture
def llama_config(tiny_model_path):
    return AutoDistributedConfig.from_pretrained(tiny_model_path("llama"))


def test_plan_divides_free_memory_by_the_cost_of_a_block(llama_config):
    per_block = estimate_block_weight_bytes(llama_config, torch.float32) + 1000 * cache_spec(
        llama_config, 0
    ).bytes_per_token(torch.float32)
    autograd = int(2 * GiB / 14336 * llama_config.hidden_size)
    num_blocks, explanation = plan_num_blocks(
        llama_config, "cpu", torch.float32, attn_cache_tokens=1000, memory_bytes=autograd + 3 * per_block + 1
    )
    assert num_blocks == 3
    assert explanation.startswith("3 blocks = the most consecutive of the model's 4 that fit in ")
    assert "KV cache for 1000 tokens" in explanation


def test_quantization_and_more_devices_fit_more_blocks(llama_config):
    llama_config.num_hidden_layers = 2000  # no cap: nf4 fits about 8x the float32 blocks
    autograd = int(2 * 2 * GiB / 14336 * llama_config.hidden_size)  # the reserve for two devices
    memory = autograd + 200 * estimate_block_weight_bytes(llama_config, torch.float32, "none")

    def plan(**kwargs):
        return plan_num_blocks(
            llama_config, "cpu", torch.float32, attn_cache_tokens=1, memory_bytes=memory, **kwargs
        )[0]

    assert plan() < plan(quant_type="int8") < plan(quant_type="nf4")
    assert plan(tensor_parallel_devices=["cpu", "cpu"]) < plan()  # the same memory, two autograd reserves


def qwen3_5_config(num_key_value_heads: int):
    """A tiny Qwen3.5: three linear-attention layers, then a full-attention one."""
    text = Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=num_key_value_heads, head_dim=16, vocab_size=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    return get_plugin_manager().family("qwen3_5_text").config_class.from_dict(text.to_dict())


def test_a_model_of_mixed_kinds_is_planned_by_each_blocks_own_cache():
    """Qwen3.5: three linear-attention blocks (a few sequence states) for each full-attention one (a
    pool of tokens): four blocks cost three small caches and one large, not four large ones."""
    config = qwen3_5_config(num_key_value_heads=2)
    linear, full = (
        estimate_block_weight_bytes(config, torch.float32, block_index=index)
        + cache_spec(config, index).budget_bytes(16384, torch.float32)
        for index in (0, 3)
    )
    assert 3 * linear < full  # so that the largest block's cost for every block would plan fewer

    def plan(memory: int) -> int:
        return plan_num_blocks(
            config, "cpu", torch.float32, attn_cache_tokens=16384, memory_bytes=AUTOGRAD_RESERVE + memory
        )[0]

    assert plan(3 * linear + full) == 4
    assert plan(3 * linear + full - 1) == 3
    assert plan(2 * linear + full - 1) == 2  # three linear blocks fit, but not three with the full one
    assert plan(linear + full - 1) == 1  # wherever the server's blocks start, the full one may be among them
    with pytest.raises(
        ValueError, match=r"not even one block fits: .* \+ 0.001 GiB to 0.004 GiB KV cache for 16384"
    ):
        plan(full - 1)


def test_blocks_are_planned_by_their_own_weights_dense_or_experts():
    """DeepSeek V3: a dense first block, then blocks of experts (20x its parameters at full size): the
    plan counts each block's weights, not block 0's for all."""
    text = DeepseekV3Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=128, n_routed_experts=16,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
    )  # fmt: skip
    config = get_plugin_manager().family("deepseek_v3").config_class.from_dict(text.to_dict())
    cache = cache_spec(config, 0).budget_bytes(1024, torch.float32)
    dense, experts = (estimate_block_weight_bytes(config, torch.float32, block_index=i) for i in (0, 1))
    assert experts > 4 * dense

    def plan(memory: int) -> tuple[int, str]:
        return plan_num_blocks(
            config, "cpu", torch.float32, attn_cache_tokens=1024, memory_bytes=AUTOGRAD_RESERVE + memory
        )

    assert plan(3 * (experts + cache))[0] == 3  # any three consecutive blocks: two or three of experts
    assert plan(3 * (experts + cache) - 1)[0] == 2  # block 0's weights for all would have planned 4
    assert f"{dense / GiB:.3f} GiB to {experts / GiB:.3f} GiB weights" in plan(experts + cache)[1]


def test_plan_is_capped_by_the_model_and_uses_host_ram_on_cpu(llama_config):
    num_blocks, explanation = plan_num_blocks(llama_config, "cpu", torch.float32, attn_cache_tokens=16)
    assert num_blocks == tiny_config("llama").num_hidden_layers
    assert "memory on cpu" in explanation


def test_adapters_take_their_share_of_each_block(llama_config, tmp_path):
    adapter = tmp_path / "adapter_model.safetensors"
    adapter.write_bytes(b"\0" * 4000 * llama_config.num_hidden_layers)
    _, explanation = plan_num_blocks(llama_config, "cpu", torch.float32, adapter_files={"a": adapter})
    assert f"+ {4000 / GiB:.3f} GiB adapters" in explanation


def test_nothing_fits_is_a_clear_error(llama_config):
    with pytest.raises(ValueError, match="not even one block fits: 0 blocks = .* Use --quant_type nf4"):
        plan_num_blocks(llama_config, "cpu", torch.float32, memory_bytes=1024)


# ---- the rules a server decides its defaults by (petals.server.planning) ----------------------

# one block of the tiny llama, by hand: hidden 64, intermediate 128, 4 query heads and 2 key/value
# heads of 16 dims: q and o 64x64, k and v 32x64, gate and up 128x64, down 64x128, two norms of 64
TINY_LLAMA_MATRIX_WEIGHTS = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64
TINY_LLAMA_VECTOR_WEIGHTS = 2 * 64
TINY_LLAMA_MATRIX_ROWS = 64 + 32 + 32 + 64 + 128 + 128 + 64
TINY_LLAMA_MATRICES = 7
TINY_LLAMA_KV_BYTES_PER_TOKEN_FP32 = 2 * 2 * 16 * 4  # keys and values, 2 heads of 16 floats
AUTOGRAD_RESERVE = int(2 * GiB / 14336 * 64)  # Petals' 2 GiB per device, scaled by hidden size


@pytest.mark.parametrize(
    ("quant_type", "weight_bytes"),
    [
        ("none", 4 * (TINY_LLAMA_MATRIX_WEIGHTS + TINY_LLAMA_VECTOR_WEIGHTS)),
        # int8: one byte per weight plus an fp32 scale per row (and a byte of format) per matrix; vectors fp32
        (
            "int8",
            TINY_LLAMA_MATRIX_WEIGHTS
            + 4 * TINY_LLAMA_MATRIX_ROWS
            + TINY_LLAMA_MATRICES
            + 4 * TINY_LLAMA_VECTOR_WEIGHTS,
        ),
        # nf4: 4 bits per weight plus a uint8 absmax per 64 weights; per matrix one nested float32 absmax
        # (of up to 256 absmaxes), the 16- and 256-entry float32 code tables and bitsandbytes' 170-byte JSON
        (
            "nf4",
            TINY_LLAMA_MATRIX_WEIGHTS // 2
            + TINY_LLAMA_MATRIX_WEIGHTS // 64
            + TINY_LLAMA_MATRICES * (4 + 4 * (16 + 256) + 170)
            + 4 * TINY_LLAMA_VECTOR_WEIGHTS,
        ),
    ],
)
def test_plan_matches_the_bytes_counted_by_hand(llama_config, quant_type, weight_bytes):
    llama_config.num_hidden_layers = 100  # so that the memory, not the model, is the limit
    per_block = weight_bytes + 1000 * TINY_LLAMA_KV_BYTES_PER_TOKEN_FP32
    for blocks in (2, 7):
        memory = AUTOGRAD_RESERVE + blocks * per_block
        for spare, expected in ((0, blocks), (-1, blocks - 1), (per_block - 1, blocks)):
            num_blocks, _ = plan_num_blocks(
                llama_config,
                "cpu",
                torch.float32,
                quant_type,
                attn_cache_tokens=1000,
                memory_bytes=memory + spare,
            )
            assert num_blocks == expected


def test_grouped_query_models_get_larger_defaults_than_full_attention_ones(tiny_model_path):
    llama, bloom, multi_query = (
        AutoDistributedConfig.from_pretrained(tiny_model_path(variant))
        for variant in ("llama", "bloom", "falcon-multi-query")
    )
    assert default_limits(llama) == default_limits(multi_query) == GROUPED_KV_LIMITS
    assert default_limits(bloom) == FULL_KV_LIMITS
    # Petals' numbers: a grouped-query model caches 4x the tokens, batches and sessions 4x longer
    assert (GROUPED_KV_LIMITS.attn_cache_tokens, FULL_KV_LIMITS.attn_cache_tokens) == (16384, 4096)
    assert (GROUPED_KV_LIMITS.max_batch_size, FULL_KV_LIMITS.max_batch_size) == (8192, 2048)
    assert (GROUPED_KV_LIMITS.inference_max_length, FULL_KV_LIMITS.inference_max_length) == (8192, 2048)


def test_a_grouped_query_model_whose_first_blocks_keep_states_gets_the_grouped_defaults():
    """Qwen3.5: linear-attention blocks first (no heads to group), then grouped-query attention."""
    config = qwen3_5_config(num_key_value_heads=2)
    kinds = [cache_spec(config, index).kind for index in range(4)]
    assert kinds == ["linear_attention"] * 3 + ["full_attention"]
    assert default_limits(config) == GROUPED_KV_LIMITS
    # one key/value head per query head: the full-attention defaults
    assert default_limits(qwen3_5_config(num_key_value_heads=4)) == FULL_KV_LIMITS


def test_the_planner_defaults_to_the_limits_a_server_would_choose(tiny_model_path):
    bloom = AutoDistributedConfig.from_pretrained(tiny_model_path("bloom"))
    _, explanation = plan_num_blocks(bloom, "cpu", torch.float32)
    assert f"KV cache for {FULL_KV_LIMITS.attn_cache_tokens} tokens" in explanation
    assert "weights (none, float32)" in explanation  # no quantization on CPU


@pytest.mark.parametrize(
    ("checkpoint_dtype", "device", "served"),
    [
        (torch.float32, "cpu", torch.float32),  # bfloat16 matmuls are slow on CPUs
        (torch.float32, "cuda", torch.bfloat16),  # half the memory on GPUs, as Petals does
        (torch.float16, "cpu", torch.float16),
        (torch.float16, "cuda", torch.float16),
        (torch.bfloat16, "cuda", torch.bfloat16),
        (None, "cuda", torch.bfloat16),  # a checkpoint that does not say
        (None, "cpu", torch.float32),
    ],
)
def test_auto_dtype_is_the_checkpoints_except_float32_on_gpus(llama_config, checkpoint_dtype, device, served):
    llama_config.dtype = checkpoint_dtype
    assert choose_dtype("auto", llama_config, torch.device(device)) == served


def test_a_dtype_asked_for_is_kept(llama_config):
    assert choose_dtype("float16", llama_config, torch.device("cpu")) == torch.float16
    assert choose_dtype(torch.bfloat16, llama_config, torch.device("cpu")) == torch.bfloat16


def test_device_is_the_one_asked_for_else_the_first_sharding_device_else_cuda_if_available():
    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert choose_device("cpu", (cuda1, cuda0), cuda_available=True) == cpu
    assert choose_device(None, (cuda1, cuda0), cuda_available=True) == cuda1
    assert choose_device(None, (), cuda_available=True) == torch.device("cuda")
    assert choose_device(None, (), cuda_available=False) == cpu
    with pytest.raises(SettingError, match="Invalid device string: 'gpu0'") as error:
        choose_device("gpu0", (), cuda_available=False)
    assert error.value.setting == "device"


def test_quantization_defaults_to_nf4_on_one_gpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_quant_type(None, cuda) == "nf4"
    assert choose_quant_type(None, cpu) == "none"
    assert choose_quant_type(None, cuda, (cuda, torch.device("cuda:1"))) == "none"
    assert choose_quant_type("int8", cpu) == "int8"


def requested(model_path, **settings) -> ServerSettings:
    return ServerSettings(str(model_path), NetworkOptions(), **settings)


def test_resolving_fills_every_open_default_from_the_rules(tiny_model_path):
    asked = requested(tiny_model_path("llama"), num_blocks=2, throughput=12.5, max_batch_size=64)
    settings = resolve_settings(asked)
    expected_device = choose_device(None, (), torch.cuda.is_available())
    assert settings == dataclasses.replace(
        asked,
        dht_prefix="tiny-llama-hf",
        device=expected_device,
        dtype=choose_dtype("auto", settings.load_config(), expected_device),
        quant_type=choose_quant_type(None, expected_device),
        throughput=ThroughputInfo(12.5),
        attn_cache_tokens=GROUPED_KV_LIMITS.attn_cache_tokens,
        inference_max_length=GROUPED_KV_LIMITS.inference_max_length,
        max_batch_size=64,  # given, so kept
    )


def test_resolving_plans_the_blocks_that_fit_when_none_are_asked_for(tiny_model_path):
    settings = resolve_settings(requested(tiny_model_path("llama"), device="cpu", throughput=1.0))
    assert settings.num_blocks == tiny_config("llama").num_hidden_layers  # tiny blocks: all fit in RAM


@pytest.mark.parametrize(
    ("asked", "setting", "message"),
    [
        ({"num_blocks": 5}, "num_blocks", "5 blocks asked, but the model has 4"),
        ({"block_indices": range(2, 6)}, "block_indices", "blocks 2:6 asked, but the model has 4"),
        ({"tensor_parallel_devices": ("gpu0",)}, "tensor_parallel_devices", "Invalid device string"),
        ({"tensor_parallel_devices": ("cuda", "cuda:0")}, "tensor_parallel_devices", "cuda:0 is named twice"),
        ({"device": "gpu0"}, "device", "Invalid device string"),
    ],
)
def test_settings_that_cannot_work_name_themselves(tiny_model_path, asked, setting, message):
    with pytest.raises(SettingError, match=message) as error:
        resolve_settings(requested(tiny_model_path("llama"), throughput=1.0, **asked))
    assert error.value.setting == setting


def test_auto_throughput_is_measured_once_then_read_from_the_cache(tiny_model_path, tmp_path):
    config = AutoDistributedConfig.from_pretrained(tiny_model_path("llama"))
    asked = requested(tiny_model_path("llama"), cache_dir=tmp_path, throughput="auto")
    settings = dataclasses.replace(asked, dtype=torch.float32, device=torch.device("cpu"), quant_type="none")
    measured = resolve_throughput(settings, config, num_blocks=3)
    assert measured.forward_rps > 0 and measured.inference_rps > 0
    assert measured.throughput == pytest.approx(measured.forward_rps / 2)  # half of 3 blocks on average
    cache = json.loads((tmp_path / CACHE_FILE).read_text())
    assert list(cache.values()) == [
        {"forward_rps": measured.forward_rps, "inference_rps": measured.inference_rps}
    ]
    assert resolve_throughput(settings, config, num_blocks=1) == dataclasses.replace(
        measured,
        throughput=measured.forward_rps,  # the cached rates, announced for 1 block
    )


def test_throughput_cache_lives_in_petals_cache_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("PETALS_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PETALS_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "petals"
