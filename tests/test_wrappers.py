"""A multimodal wrapper checkpoint (``model_type`` gemma3, qwen3_5, qwen3_5_moe, mistral3, llama4) is served
as the text model it wraps: its config resolves to the text model's plugin, its language-model tensors
load under the text model's names, the wrapper decides whether the head is tied and how the weights are
quantized, and the vision tower is never read. A text type without a plugin is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, Gemma3Config

import petals
from conftest import LOOPBACK_CLIENT, InProcessDht, save_random_wrapper, serving_only
from petals import hookimpl
from petals.auto import AutoDistributedConfig
from petals.config import DistributedConfigMixin
from petals.loading import Checkpoint, load_block, open_checkpoint
from petals.plugins import PluginManager
from petals.wrappers import TextCheckpoint, WrappedTypeWithoutPluginError, served_model_type

TEXT_TYPES = {
    "gemma3": "gemma3_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "mistral3": "mistral",
    "llama4": "llama4_text",
}
# where transformers' wrapper model keeps its text decoder
DECODERS = {"llama4": "language_model.model"}
VISION_PREFIXES = ("vision_tower.", "vision_model.", "model.visual.", "multi_modal_projector.")


def wrapper_decoder(wrapper_type: str, path) -> torch.nn.Module:
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return model.get_submodule(DECODERS.get(wrapper_type, "model.language_model"))


@pytest.mark.parametrize("wrapper_type", sorted(TEXT_TYPES))
def test_a_wrapper_config_resolves_to_its_text_models_plugin(wrapper_type, tiny_wrapper_path):
    path = tiny_wrapper_path(wrapper_type)
    config = AutoDistributedConfig.from_pretrained(path)
    assert isinstance(config, DistributedConfigMixin)
    assert config.model_type == TEXT_TYPES[wrapper_type]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 4, 1000)
    assert config.dht_prefix  # derived from the folder's name by the text family's rule
    assert AutoDistributedConfig.from_pretrained(path, dht_prefix="chosen").dht_prefix == "chosen"


@pytest.mark.parametrize("wrapper_type", sorted(TEXT_TYPES))
def test_every_block_loads_the_wrappers_own_layer(wrapper_type, tiny_wrapper_path):
    path = tiny_wrapper_path(wrapper_type)
    decoder = wrapper_decoder(wrapper_type, path)
    config = AutoDistributedConfig.from_pretrained(path)
    checkpoint = open_checkpoint(path)
    assert isinstance(checkpoint, TextCheckpoint)
    for index in range(config.num_hidden_layers):
        block = load_block(path, index, config=config, checkpoint=checkpoint)
        expected = decoder.layers[index].state_dict()
        loaded = block.state_dict()
        assert sorted(loaded) == sorted(expected)
        assert all(torch.equal(loaded[name], expected[name]) for name in expected)


@pytest.mark.parametrize("wrapper_type", sorted(TEXT_TYPES))
def test_the_text_part_is_named_as_the_text_causal_lm_names_it(wrapper_type, tiny_wrapper_path):
    names = set(open_checkpoint(tiny_wrapper_path(wrapper_type)).weight_map)
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= names
    assert all(
        name.startswith(("model.embed_tokens.", "model.norm.", "model.layers.", "lm_head.")) for name in names
    )


def test_the_wrapper_decides_whether_the_head_is_tied(tmp_path):
    # Gemma 3 ties in its wrapper and text config, Mistral 3 only in its wrapper; Qwen 3.5 ties in neither
    tied = {"gemma3": True, "mistral3": True, "qwen3_5": False}
    for wrapper_type, expected in tied.items():
        path = save_random_wrapper(wrapper_type, tmp_path / wrapper_type)
        stored = json.loads((path / "config.json").read_text())
        assert stored["tie_word_embeddings"] is expected
        assert AutoDistributedConfig.from_pretrained(path).tie_word_embeddings is expected
        assert ("lm_head.weight" in open_checkpoint(path).weight_map) is not expected
    assert (
        json.loads((tmp_path / "mistral3" / "config.json").read_text())["text_config"]["tie_word_embeddings"]
        is False
    )


def test_the_client_ties_a_tied_wrappers_head_and_reads_no_vision_tensor(tmp_path, monkeypatch):
    path = save_random_wrapper("mistral3", tmp_path / "mistral3")
    reads: list[str] = []
    real_read = Checkpoint.read

    def recording_read(self, keys, dtype=None, packed=False):
        reads.extend(keys)
        return real_read(self, keys, dtype, packed)

    monkeypatch.setattr(Checkpoint, "read", recording_read)
    decoder = wrapper_decoder("mistral3", path)
    with InProcessDht().start() as dht:
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        try:
            assert model.lm_head.weight is model.model.embed_tokens.weight
            assert torch.equal(model.model.embed_tokens.weight, decoder.embed_tokens.weight)
        finally:
            model.close()
    for index in range(4):
        load_block(path, index)
    assert reads and not any(key.startswith(VISION_PREFIXES) for key in reads)
    assert {key for key in reads if key.startswith("language_model.model.layers.")}  # the blocks' own names


def test_a_quantized_wrappers_blocks_are_dequantized_by_its_quantization_config(tiny_wrapper_path, tmp_path):
    """fp8 with one scale a tensor, the format named at the top of the wrapper's config.json, as a
    quantizer writes it, and not in its text_config."""
    source = tiny_wrapper_path("mistral3")
    layer = "language_model.model.layers.0."
    stored, expected = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        stored[name] = tensor
        if name.startswith(layer) and tensor.ndim == 2:
            scale_inv = tensor.abs().max() / torch.finfo(torch.float8_e4m3fn).max
            stored[name] = (tensor / scale_inv).to(torch.float8_e4m3fn)
            stored[f"{name}_scale_inv"] = scale_inv
        if name.startswith(layer):
            expected[name.removeprefix(layer)] = stored[name].to(torch.float32) * stored.get(
                f"{name}_scale_inv", torch.tensor(1.0)
            )
    path = tmp_path / "fp8-wrapper"
    path.mkdir()
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": None}
    (path / "config.json").write_text(json.dumps(config))

    assert AutoDistributedConfig.from_pretrained(path).quantization_config["quant_method"] == "fp8"
    loaded = load_block(path, 0, torch.float32, weights="dequantized").state_dict()
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_a_text_type_without_a_plugin_is_refused_in_one_line(tiny_wrapper_path):
    path = tiny_wrapper_path("qwen3_5")
    with serving_only(object(), "nothing"), pytest.raises(WrappedTypeWithoutPluginError) as error:
        AutoDistributedConfig.from_pretrained(path)
    message = str(error.value)
    assert "\n" not in message
    assert "'qwen3_5'" in message and "'qwen3_5_text'" in message and "install a plugin" in message


def test_petals_serve_names_the_wrapper_and_the_missing_text_plugin(tiny_wrapper_path):
    path = tiny_wrapper_path("gemma3")
    result = subprocess.run(
        [sys.executable, "-m", "petals.cli", "serve", str(path), "--loopback", "--new_swarm"],
        capture_output=True,
        text=True,
        env={**os.environ, "PETALS_PLUGINS": "llama"},
        timeout=120,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "gemma3_text" in line]
    assert len(errors) == 1 and "'gemma3'" in errors[0] and "install a plugin" in errors[0], result.stderr


def test_a_wrapper_type_with_a_plugin_of_its_own_is_served_as_itself():
    class DistributedWrapperConfig(DistributedConfigMixin, Gemma3Config):
        block_prefix = "model.language_model.layers"

    class WrapperPlugin:
        @hookimpl
        def register_model_families(self, register):
            register(DistributedWrapperConfig)

    manager = PluginManager()
    manager.register(WrapperPlugin(), name="wrapper")
    config_dict = Gemma3Config().to_dict()
    assert served_model_type(config_dict, manager) == "gemma3"
    with pytest.raises(WrappedTypeWithoutPluginError):
        served_model_type(config_dict, PluginManager())
