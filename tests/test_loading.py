"""load_block reads one block's tensors only, from a directory or the HF cache, in any layout."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, conversion_mapping
from transformers.core_model_loading import WeightRenaming

import petals.checkpoint
import petals.loading
import petals.plugins
from conftest import install_in_hf_cache, tiny_config
from petals.auto import AutoDistributedConfig
from petals.loading import CheckpointError, load_block, open_checkpoint


def reference_layer_state(path, variant, index):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prefix = AutoDistributedConfig.from_pretrained(path).block_prefix
    return model.get_submodule(f"{prefix}.{index}").state_dict()


@pytest.fixture
def opened_files(monkeypatch):
    """Records which checkpoint files safetensors opens (the real function still does the work)."""
    opened = []
    real_safe_open = petals.checkpoint.safe_open

    def recording_safe_open(path, *args, **kwargs):
        opened.append(str(path).rsplit("/", 1)[-1])
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(petals.checkpoint, "safe_open", recording_safe_open)
    return opened


def test_sharded_checkpoint_reads_only_the_shards_holding_the_block(tmp_path, opened_files):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of_block_2 = {file for name, file in weight_map.items() if name.startswith("model.layers.2.")}
    assert len(set(weight_map.values())) > len(shards_of_block_2)

    block = load_block(tmp_path, 2, torch.float32)

    assert set(opened_files) == shards_of_block_2
    expected = model.model.layers[2].state_dict()
    assert block.state_dict().keys() == expected.keys()
    assert all(torch.equal(block.state_dict()[k], v) for k, v in expected.items())
    assert not any(p.requires_grad for p in block.parameters()) and not block.training


def test_short_prefix_layout_loads_too(tiny_model_path, tmp_path):
    """bigscience BLOOM repos store "h.N." where save_pretrained writes "transformer.h.N."."""
    source = tiny_model_path("bloom")
    tensors = load_file(source / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    block = load_block(tmp_path, 1)
    expected = reference_layer_state(source, "bloom", 1)
    assert all(torch.equal(block.state_dict()[k], v) for k, v in expected.items())


def test_mixtral_experts_are_fused_on_load(tiny_model_path):
    path = tiny_model_path("mixtral")
    block = load_block(path, 3)
    expected = reference_layer_state(path, "mixtral", 3)
    assert block.state_dict().keys() == expected.keys()
    assert all(torch.equal(block.state_dict()[k], v) for k, v in expected.items())


def test_dtype_conversion(tiny_model_path):
    block = load_block(tiny_model_path("llama"), 0, torch.bfloat16)
    assert {p.dtype for p in block.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensors_transformers_keeps_in_float32_stay_float32(tmp_path, dtype):
    """DeepSeek V3's router weights and score-correction biases route in float32 in transformers whatever
    the model's dtype; a block loaded in bfloat16 or float16 keeps exactly the tensors transformers keeps."""
    from transformers import DeepseekV3Config

    from conftest import save_random_model

    config = DeepseekV3Config(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=64, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
        q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1,
    )  # fmt: skip
    path = save_random_model(config, tmp_path / "deepseek")
    if "deepseek_v3" not in petals.plugins.get_plugin_manager().model_families():
        pytest.skip("petals-deepseek is not installed here: pip install ./petals_deepseek")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).model.layers[1].state_dict()
    block = load_block(path, 1, dtype)
    dtypes = {name: tensor.dtype for name, tensor in block.state_dict().items()}
    assert dtypes == {name: tensor.dtype for name, tensor in reference.items()}
    assert {name for name, d in dtypes.items() if d == torch.float32} == {
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
    }


def test_repo_id_in_hf_cache_loads_offline(tiny_model_path, offline_hf_cache):
    install_in_hf_cache(tiny_model_path("falcon-new"), "tiiuae/falcon-tiny", offline_hf_cache)
    script = (
        "import torch; from petals import load_block; "
        "b = load_block('tiiuae/falcon-tiny', 2, torch.float32); print(sum(p.numel() for p in b.parameters()))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    expected = sum(
        v.numel() for v in reference_layer_state(tiny_model_path("falcon-new"), "falcon", 2).values()
    )
    assert int(result.stdout.split()[-1]) == expected


def test_pickle_only_checkpoint_is_refused_without_unpickling(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not even read")
    with pytest.raises(CheckpointError, match="only pickle weights"):
        open_checkpoint(tmp_path)


def test_missing_checkpoint_and_bad_block_index(tiny_model_path, tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="found neither"):
        load_block(tmp_path, 0)
    with pytest.raises(IndexError, match="block 4 out of range: the model has 4 blocks"):
        load_block(tiny_model_path("llama"), 4)


@pytest.fixture
def scratch_conversion_mappings(monkeypatch):
    """transformers' table of checkpoint conversions, restored after the test."""
    conversion_mapping.get_checkpoint_conversion_mapping("legacy")  # builds the table
    monkeypatch.setattr(
        conversion_mapping,
        "_checkpoint_conversion_mapping_cache",
        dict(conversion_mapping._checkpoint_conversion_mapping_cache),
    )
    monkeypatch.setattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", set())


def test_checkpoint_names_follow_transformers_conversion_for_the_model_type(
    tiny_model_path, tmp_path, scratch_conversion_mappings
):
    """Checkpoints whose MLP tensors carry an older name ("ffn." instead of "mlp.") load once the
    renaming is registered with transformers, as transformers itself would then load them."""
    source = tiny_model_path("llama")
    tensors = load_file(source / "model.safetensors")
    save_file({k.replace(".mlp.", ".ffn."): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(
        CheckpointError, match="block 0 does not match .*missing mlp.gate_proj.weight.*unexpected ffn"
    ):
        load_block(tmp_path, 0)
    conversion_mapping.register_checkpoint_conversion_mapping("llama", [WeightRenaming(".ffn.", ".mlp.")])
    block = load_block(tmp_path, 0)
    assert torch.equal(block.mlp.up_proj.weight, tensors["model.layers.0.mlp.up_proj.weight"])
