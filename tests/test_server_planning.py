"""How many blocks a server takes: weights after quantization, exact KV cache, adapters, autograd reserve."""

import pytest
import torch

from conftest import tiny_config
from petals.auto import AutoDistributedConfig
from petals.block import kv_cache_layout
from petals.convert import estimate_block_weight_bytes
from petals.server.planning import GiB, plan_num_blocks


@pytest.fixture
def llama_config(tiny_model_path):
    return AutoDistributedConfig.from_pretrained(tiny_model_path("llama"))


def test_plan_divides_free_memory_by_the_cost_of_a_block(llama_config):
    per_block = estimate_block_weight_bytes(llama_config, torch.float32) + 1000 * kv_cache_layout(
        llama_config
    ).bytes_per_token(torch.float32)
    autograd = int(2 * GiB / 14336 * llama_config.hidden_size)
    num_blocks, explanation = plan_num_blocks(
        llama_config, "cpu", torch.float32, attn_cache_tokens=1000, memory_bytes=autograd + 3 * per_block + 1
    )
    assert num_blocks == 3
    assert explanation.startswith("3 blocks = min(floor((")
    assert "KV cache for 1000 tokens" in explanation


def test_quantization_and_more_devices_fit_more_blocks(llama_config):
    llama_config.num_hidden_layers = 10**6  # no cap
    memory = 4 * GiB

    def plan(**kwargs):
        return plan_num_blocks(
            llama_config, "cpu", torch.float32, attn_cache_tokens=0, memory_bytes=memory, **kwargs
        )[0]

    assert plan() < plan(quant_type="int8") < plan(quant_type="nf4")
    assert plan(tensor_parallel_devices=["cpu", "cpu"]) < plan()  # the same memory, two autograd reserves


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
