"""LoRA adapters preloaded onto a served block: each equals local peft, none equals the base model."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import bnb as peft_bnb
from transformers import AutoModelForCausalLM

from petals.convert import AdapterError, load_adapters, quantize_block, using_adapter
from petals.loading import load_block

BLOCK_INDEX = 1
ADAPTERS = {
    "attn": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    "mlp": LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"], init_lora_weights=False),
}


@pytest.fixture(scope="module")
def adapter_setup(tiny_model_path, tmp_path_factory):
    """The tiny Llama, two adapters saved with safetensors, and each model's hidden states."""
    path = tiny_model_path("llama")
    inputs = torch.randint(0, 1000, (2, 6))
    directories, hidden = {}, {}
    for seed, (name, lora_config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora_config).eval()
        directories[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(directories[name], safe_serialization=True)
        hidden[name] = model(inputs, output_hidden_states=True).hidden_states
        with model.disable_adapter():
            hidden[None] = model(inputs, output_hidden_states=True).hidden_states
    return path, directories, hidden


def _block_with_adapters(path, directories):
    block = load_block(path, BLOCK_INDEX)
    return load_adapters(block, BLOCK_INDEX, directories, block.config)


@pytest.mark.parametrize("adapter", [None, "attn", "mlp"])
def test_each_adapter_equals_local_peft_and_none_equals_base(adapter_setup, adapter):
    path, directories, hidden = adapter_setup
    block = _block_with_adapters(path, directories)
    with torch.no_grad(), using_adapter(block, adapter):
        output = block(hidden[adapter][BLOCK_INDEX])
    torch.testing.assert_close(output, hidden[adapter][BLOCK_INDEX + 1], atol=1e-4, rtol=0)
    with torch.no_grad():  # outside the context the block is the base model again
        torch.testing.assert_close(
            block(hidden[None][BLOCK_INDEX]), hidden[None][BLOCK_INDEX + 1], atol=1e-4, rtol=0
        )


def test_adapter_on_an_nf4_block_uses_peft_bitsandbytes_layers(adapter_setup):
    path, directories, hidden = adapter_setup
    block = quantize_block(load_block(path, BLOCK_INDEX), "nf4")
    load_adapters(block, BLOCK_INDEX, directories, block.config)
    assert isinstance(block.self_attn.q_proj, peft_bnb.Linear4bit)
    inputs, expected = hidden["attn"][BLOCK_INDEX], hidden["attn"][BLOCK_INDEX + 1]
    with torch.no_grad(), using_adapter(block, "attn"):
        output = block(inputs)
    with torch.no_grad():
        assert not torch.allclose(output, block(inputs))
    assert (output - expected).norm() / (
        expected - inputs
    ).norm() < 0.25  # the nf4 bound of test_convert_quantization


def test_unknown_adapter_names_the_loaded_ones(adapter_setup):
    path, directories, _ = adapter_setup
    block = _block_with_adapters(path, directories)
    with pytest.raises(AdapterError, match=r"adapter 'chat' is not loaded on this server; loaded: attn, mlp"):
        with using_adapter(block, "chat"):
            pass


def test_pickle_only_adapter_is_refused_without_unpickling(tmp_path, tiny_model_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"not even a pickle: must never be opened")
    block = load_block(tiny_model_path("llama"), BLOCK_INDEX)
    with pytest.raises(AdapterError, match=r"only the pickle file adapter_model.bin, which petals refuses"):
        load_adapters(block, BLOCK_INDEX, {"evil": tmp_path}, block.config)
