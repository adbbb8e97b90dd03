"""Published FP8 checkpoints load as they are published, dequantized on CPU to the serving dtype.

Fixtures quantize a tiny random model following the format's specification: every linear weight of
the decoder layers (the MoE router excepted, as DeepSeek V3 publishes it) is stored as
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` (one per ``weight_block_size`` block, edge
blocks cropped, or one per tensor), ``quantization_config`` in config.json as the real releases
write it, one shard per layer. The reference is the same model with those weights dequantized,
saved in float32 and loaded by plain transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, FineGrainedFP8Config, Qwen3MoeConfig

import petals
from conftest import LOOPBACK_CLIENT, inprocess_swarm, save_random_model, tiny_config
from petals.auto import AutoDistributedConfig
from petals.checkpoint import Checkpoint
from petals.cli import main
from petals.convert import convert_block
from petals.formats import CheckpointFormatError, PackedWeight
from petals.formats.fp8 import FP8
from petals.loading import load_block, open_checkpoint
from petals.testing.swarm import running_swarm

# as tests/test_convert_quantization.py measures them, on the block's update y - x
MAX_RELATIVE_ERROR = {"int8": 0.03, "nf4": 0.25}
QUANTIZED_LINEAR = {"int8": "Linear8bitLt", "nf4": "Linear4bit"}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
DEEPSEEK_V3 = DeepseekV3Config(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=1000,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


def dequantize_fp8(tensors: dict, quantization_config: dict, dtype: torch.dtype) -> dict:
    """The fp8 format's own reading, each packed weight dequantized."""
    return {
        name: value.dequantize() if isinstance(value, PackedWeight) else value
        for name, value in FP8.pack(tensors, quantization_config, dtype).items()
    }


QWEN3_MOE = Qwen3MoeConfig(  # an MoE whose checkpoints store every expert as linears of its own
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
)


def quantize_fp8(weight: torch.Tensor, block_size: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 weight, weight_scale_inv)``: each block's largest magnitude maps to 448."""
    if block_size is None:
        scale_inv = weight.abs().max().clamp(min=1e-12) / E4M3_MAX
        return (weight / scale_inv).to(torch.float8_e4m3fn), scale_inv.to(torch.float32)
    rows, cols = block_size
    grid = (math.ceil(weight.shape[0] / rows), math.ceil(weight.shape[1] / cols))
    scale_inv = torch.empty(grid, dtype=torch.float32)
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            scale_inv[i, j] = block.abs().max().clamp(min=1e-12) / E4M3_MAX
            quantized[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (block / scale_inv[i, j]).to(
                torch.float8_e4m3fn
            )
    return quantized, scale_inv


def dequantize_by_blocks(
    quantized: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int] | None
) -> torch.Tensor:
    """The specification's dequantization, one block at a time."""
    weight = quantized.to(torch.float32)
    if block_size is None:
        return weight * scale_inv
    rows, cols = block_size
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] *= scale_inv[i, j]
    return weight


def is_quantized_in_release(name: str, tensor: torch.Tensor) -> bool:
    """Decoder layers' linear weights; the router, norms and everything outside the layers stay as they are."""
    return name.startswith("model.layers.") and tensor.ndim == 2 and not name.endswith("mlp.gate.weight")


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 weight, [rows, 1] scale)``: each row's largest magnitude maps to 448 (AutoFP8's and
    llm-compressor's per-channel strategy)."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (weight / scale).to(torch.float8_e4m3fn), scale.to(torch.float32)


# how each FP8 layout names a weight's scale, quantizes a weight, and what its config.json says
FP8_LAYOUTS = {
    "fp8": "weight_scale_inv",  # DeepSeek V3's, transformers' FineGrainedFP8Config
    "autofp8": "weight_scale",  # AutoFP8: per channel, with a static input_scale
    "compressed-tensors": "weight_scale",  # llm-compressor's float-quantized, per channel
}


def save_fp8_checkpoint(
    config, path: Path, block_size: list[int] | None, also: tuple[str, ...] = (), layout: str = "fp8"
) -> tuple[Path, Path]:
    """``(fp8 checkpoint, its dequantized float32 twin)`` of one random model of ``config``; ``also``
    names tensors outside the layers to quantize too; ``layout`` one of ``FP8_LAYOUTS`` (AutoFP8 and
    compressed-tensors per output channel, ``block_size`` unused)."""
    source = save_random_model(config, path / "source")
    tensors = load_file(source / "model.safetensors")
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        if is_quantized_in_release(name, tensor) or name in also:
            if layout == "fp8":
                quantized, scale = quantize_fp8(tensor, block_size)
                dequantized[name] = dequantize_by_blocks(quantized, scale, block_size)
            else:
                quantized, scale = quantize_fp8_per_channel(tensor)
                dequantized[name] = quantized.to(torch.float32) * scale
                stored[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)  # static, dropped
            stored[name], stored[f"{name.removesuffix('weight')}{FP8_LAYOUTS[layout]}"] = quantized, scale
        else:
            stored[name] = dequantized[name] = tensor
    fp8, reference = path / "fp8", path / "reference"
    reference.mkdir()
    (reference / "config.json").write_text((source / "config.json").read_text())
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    save_by_layer(stored, fp8)
    config_json = json.loads((source / "config.json").read_text())
    config_json["quantization_config"] = _fp8_quantization_config(layout, block_size)
    (fp8 / "config.json").write_text(json.dumps(config_json, indent=2))
    return fp8, reference


def _fp8_quantization_config(layout: str, block_size: list[int] | None) -> dict:
    """config.json's quantization_config as each tool writes it."""
    if layout == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": block_size,
        }
    if layout == "autofp8":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
            }
        },
    }


def save_by_layer(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One shard per decoder layer and one for the rest, with its index, as the large releases ship."""
    path.mkdir()
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        shard = (
            f"model-layer-{parts[2]}.safetensors"
            if name.startswith("model.layers.")
            else "model-rest.safetensors"
        )
        shards.setdefault(shard, {})[name] = tensor
    for shard, contents in shards.items():
        save_file(contents, path / shard, metadata={"format": "pt"})
    weight_map = {name: shard for shard, contents in shards.items() for name in contents}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


LAYOUTS = {  # model, weight_block_size: blocks that crop at the edges, blocks that do not, one scale per tensor
    "llama-blockwise": ("llama", [16, 24]),
    "llama-per-tensor": ("llama", None),
    "deepseek-v3-blockwise": ("deepseek_v3", [16, 16]),
    "deepseek-v3-whole-blocks": ("deepseek_v3", [8, 8]),
    # one scale per output channel, as AutoFP8 and llm-compressor write them (an MoE's experts one by one)
    "llama-autofp8": ("llama", "autofp8"),
    "qwen3-moe-compressed-tensors": ("qwen3_moe", "compressed-tensors"),
}
# transformers 5.24 dequantizes FP8 on CPU (FineGrainedFP8Config(dequantize=True), also its automatic CPU
# fallback) with blocks of rows / scale rows, so cropped edge blocks, which DeepSeek V3 has (kv_a_proj_with_mqa:
# 576 rows, 5 scale rows), fail ("Weight shape (576, 7168) not divisible by scale grid (5, 56).") or, where the
# division is exact (24 rows in two 16-row blocks), are misread; it reads these layouts as they are:
TRANSFORMERS_READS = {"deepseek-v3-whole-blocks", "llama-per-tensor"}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """``fp8_checkpoint(layout)`` → (fp8 checkpoint, dequantized float32 reference)."""
    built: dict[str, tuple[Path, Path]] = {}

    def build(layout: str) -> tuple[Path, Path]:
        if layout not in built:
            model, block_size = LAYOUTS[layout]
            config = (
                DEEPSEEK_V3
                if model == "deepseek_v3"
                else QWEN3_MOE
                if model == "qwen3_moe"
                else tiny_config(model)
            )
            kind = block_size if isinstance(block_size, str) else "fp8"
            block_size = None if isinstance(block_size, str) else block_size
            built[layout] = save_fp8_checkpoint(
                config, tmp_path_factory.mktemp(layout), block_size, layout=kind
            )
        return built[layout]

    return build


def reference_layer(reference: Path, index: int) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).model.layers[index]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_served_block_equals_the_dequantized_reference(fp8_checkpoint, layout):
    fp8, reference = fp8_checkpoint(layout)
    dequantized = load_block(fp8, 2, torch.float32, weights="dequantized")
    packed = load_block(fp8, 2, torch.float32)

    expected = reference_layer(reference, 2).state_dict()
    assert dequantized.state_dict().keys() == expected.keys()
    assert all(torch.equal(dequantized.state_dict()[name], tensor) for name, tensor in expected.items())
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    reference_output = load_block(reference, 2, torch.float32)(hidden)
    assert (dequantized(hidden) - reference_output).abs().max().item() <= 1e-5
    assert (packed(hidden) - dequantized(hidden)).abs().max().item() <= 1e-6


def test_weights_take_the_serving_dtype(fp8_checkpoint):
    block = load_block(fp8_checkpoint("deepseek-v3-blockwise")[0], 1, torch.bfloat16, weights="dequantized")
    dtypes = {name: tensor.dtype for name, tensor in block.state_dict().items() if tensor.is_floating_point()}
    # the router stays in float32, as transformers keeps it (_keep_in_fp32_modules_strict)
    kept = {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
    assert {name: dtypes[name] for name in kept} == dict.fromkeys(kept, torch.float32)
    assert {dtype for name, dtype in dtypes.items() if name not in kept} == {torch.bfloat16}


def test_a_server_of_blocks_reads_only_their_tensors_and_scales(fp8_checkpoint, monkeypatch):
    fp8, _ = fp8_checkpoint("deepseek-v3-blockwise")
    read: list[str] = []
    real_read = Checkpoint.read
    monkeypatch.setattr(
        Checkpoint,
        "read",
        lambda self, keys, *rest, **kw: read.extend(keys) or real_read(self, keys, *rest, **kw),
    )
    config = AutoDistributedConfig.from_pretrained(fp8)
    checkpoint = open_checkpoint(fp8)

    for index in (1, 2):  # what a server of blocks 1:3 loads
        load_block(fp8, index, torch.float32, config=config, checkpoint=checkpoint)

    served = {
        name for name in checkpoint.weight_map if name.startswith(("model.layers.1.", "model.layers.2."))
    }
    assert set(read) == served
    assert {checkpoint.weight_map[name] for name in read} == {
        "model-layer-1.safetensors",
        "model-layer-2.safetensors",
    }
    assert any(name.endswith("experts.3.down_proj.weight_scale_inv") for name in read)


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_quant_type_quantizes_the_dequantized_weights_again(fp8_checkpoint, quant_type):
    fp8, reference = fp8_checkpoint("llama-blockwise")
    config = AutoDistributedConfig.from_pretrained(fp8)
    block = convert_block(
        load_block(fp8, 1, torch.float32), 1, config, dtype=torch.float32, device="cpu", quant_type=quant_type
    )
    assert {type(module).__name__ for module in block.modules()} >= {QUANTIZED_LINEAR[quant_type]}
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    expected_update = load_block(reference, 1, torch.float32)(hidden) - hidden
    error = (block(hidden) - hidden - expected_update).norm() / expected_update.norm()
    assert error < MAX_RELATIVE_ERROR[quant_type]


@pytest.fixture
def unknown_method_checkpoint(fp8_checkpoint, tmp_path) -> Path:
    """A checkpoint that says it is quantized with a method petals does not read."""
    fp8, _ = fp8_checkpoint("llama-per-tensor")
    for file in fp8.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config_json = json.loads((fp8 / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "hqq"}
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    return tmp_path


def test_unknown_quantization_method_is_refused_by_name(unknown_method_checkpoint):
    with pytest.raises(
        CheckpointFormatError,
        match="quant_method 'hqq', which petals cannot read yet .*reads: awq, compressed-tensors, fp8, gptq, mxfp4",
    ):
        load_block(unknown_method_checkpoint, 0)


def test_a_server_refuses_an_unknown_quantization_method_in_one_line_before_it_announces(
    unknown_method_checkpoint,
):
    result = CliRunner().invoke(main, ["serve", str(unknown_method_checkpoint), "--new_swarm"])
    assert result.exit_code == 1
    assert (
        "quant_method 'hqq', which petals cannot read yet (it reads: awq, compressed-tensors, fp8, gptq, mxfp4)"
        in result.output
    )
    assert "Traceback" not in result.output


def test_scales_of_the_wrong_grid_are_refused():
    weight = torch.zeros(24, 40, dtype=torch.float8_e4m3fn)
    tensors = {"q_proj.weight": weight, "q_proj.weight_scale_inv": torch.ones(2, 2)}
    with pytest.raises(CheckpointFormatError, match=r"needs scales of shape \(2, 3\)"):
        dequantize_fp8(tensors, {"weight_block_size": [16, 16]}, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    ["deepseek-v3-blockwise", "deepseek-v3-whole-blocks", "llama-per-tensor", "qwen3-moe-compressed-tensors"],
)
def test_greedy_tokens_through_two_servers_equal_transformers_on_the_dequantized_model(
    fp8_checkpoint, layout, tmp_path
):
    """Against transformers on the dequantized float32 copy, and on the FP8 checkpoint itself where it
    reads it (``TRANSFORMERS_READS``)."""
    fp8, reference = fp8_checkpoint(layout)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).generate(ids, **kwargs)
    if layout in TRANSFORMERS_READS:
        own = AutoModelForCausalLM.from_pretrained(
            fp8, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
        ).generate(ids, **kwargs)
        assert torch.equal(own.sequences, expected.sequences)
        own_diff = max((a - b).abs().max().item() for a, b in zip(own.logits, expected.logits, strict=True))
        assert own_diff < 1e-5, own_diff

    with running_swarm(fp8, "0:2", "2:4", env={"PETALS_CACHE": str(tmp_path)}) as (dht, servers):
        for server in servers:
            assert "served packed on cpu: weights stay in their stored bytes" in server.log
        # the throughput they announce is measured on a block they serve, packed (cached under its format)
        measured = json.loads((tmp_path / "throughput_v1.json").read_text())
        assert any("_packed_fp8" in key for key in measured), measured
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            fp8, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4


def test_a_client_reads_a_head_stored_in_fp8_dequantized(tmp_path):
    fp8, reference = save_fp8_checkpoint(tiny_config("llama"), tmp_path, [16, 24], also=("lm_head.weight",))
    with inprocess_swarm(fp8, "0:4") as (dht, _):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            fp8, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        head = model.get_output_embeddings().weight
        model.close()
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).lm_head.weight
    assert head.dtype == torch.float32 and torch.equal(head, expected)


def test_blocks_are_128_by_128_when_the_config_does_not_say():
    quantized, scale_inv = quantize_fp8(torch.randn(200, 130), [128, 128])
    tensors = {"o_proj.weight": quantized, "o_proj.weight_scale_inv": scale_inv}
    dequantized = dequantize_fp8(tensors, {"quant_method": "fp8"}, torch.float32)["o_proj.weight"]
    assert torch.equal(dequantized, dequantize_by_blocks(quantized, scale_inv, [128, 128]))


@pytest.mark.parametrize("block_size", [[128, 128], [16, 24], None])
def test_each_weight_is_rounded_once_to_the_serving_dtype(block_size):
    """Dequantized by bands of rows in float32, then cast: the same as the whole weight at once."""
    quantized, scale_inv = quantize_fp8(torch.randn(300, 200), block_size)
    tensors = {"o_proj.weight": quantized, "o_proj.weight_scale_inv": scale_inv}
    config = {"quant_method": "fp8", "weight_block_size": block_size}
    dequantized = dequantize_fp8(tensors, config, torch.bfloat16)["o_proj.weight"]
    expected = dequantize_by_blocks(quantized, scale_inv, block_size).to(torch.bfloat16)
    assert dequantized.dtype == torch.bfloat16 and torch.equal(dequantized, expected)


@pytest.mark.parametrize("per_channel", [False, True])
def test_autofp8_weight_scale_is_read_and_input_scale_dropped(per_channel):
    """AutoFP8's layout (transformers 5.24 drops these scales and reads the weights unscaled)."""
    weight = torch.randn(16, 32)
    scale = (
        weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX if per_channel else weight.abs().max() / E4M3_MAX
    )
    codes = (weight / scale).to(torch.float8_e4m3fn)
    tensors = {"q_proj.weight": codes, "q_proj.weight_scale": scale, "q_proj.input_scale": torch.ones(())}
    dequantized = dequantize_fp8(
        tensors, {"quant_method": "fp8", "activation_scheme": "static"}, torch.float32
    )
    assert dequantized.keys() == {"q_proj.weight"}
    assert torch.equal(dequantized["q_proj.weight"], codes.to(torch.float32) * scale)


@pytest.mark.parametrize(
    ("weight_dtype", "scale_dtype"),
    [(torch.int8, torch.float32), (torch.float8_e4m3fn, torch.uint8)],  # FP4-packed experts, ue8m0 scales
)
def test_other_layouts_under_fp8_are_refused_not_misread(weight_dtype, scale_dtype):
    tensors = {
        "w1.weight": torch.zeros(16, 16, dtype=weight_dtype),
        "w1.weight_scale_inv": torch.ones(1, 1, dtype=scale_dtype),
    }
    with pytest.raises(CheckpointFormatError, match="is not an fp8 layout petals reads"):
        dequantize_fp8(tensors, {"weight_block_size": [16, 16]}, torch.float32)
