"""MXFP4, GPTQ and AWQ checkpoints load as they are published, dequantized on CPU to the serving dtype.

Fixtures quantize a tiny random model following each format's specification, with code written
here independently of ``petals.checkpoint_formats`` (it packs where petals unpacks):

- MXFP4 as GPT-OSS publishes it: the experts' ``gate_up_proj`` and ``down_proj`` as ``*_blocks``
  (uint8, two FP4 e2m1 codes a byte, low nibble first, 32 a group along the input) and ``*_scales``
  (uint8 e8m0), everything else dense, ``quantization_config`` as in openai/gpt-oss-20b;
- GPTQ (AutoGPTQ/GPTQModel, ``checkpoint_format`` "gptq", v1 zeros stored minus one): ``qweight``
  packed along the input, ``qzeros`` along the output, float16 ``scales``, ``g_idx`` (permuted for
  ``desc_act``), every linear of the decoder layers;
- AWQ GEMM (AutoAWQ): ``qweight``/``qzeros`` packed along the output in AWQ's interleaved order.

One shard per layer (``save_by_layer``). The reference is the same model with those weights
dequantized by the specification's formula, saved in float32 and loaded by plain transformers.

4-bit GPTQ and AWQ weights are held for torch's CPU int4 kernel (``GroupedInt4Weight``): they still
dequantize bit for bit to the specification's weights, and in bfloat16 the kernel computes with them
within bfloat16's rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_checkpoint_formats import MAX_RELATIVE_ERROR, QUANTIZED_LINEAR, save_by_layer
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config, Qwen3MoeConfig

import petals
from conftest import LOOPBACK_CLIENT, petals_health, save_random_model, tiny_config
from petals.auto import AutoDistributedConfig
from petals.checkpoint import Checkpoint
from petals.convert import block_weight_bytes, convert_block
from petals.formats import CheckpointFormatError, PackedWeight, int4pack, weights_note
from petals.formats.int4 import AWQ, GPTQ, GptqWeight, GroupedInt4Weight, GroupedIntWeight
from petals.formats.mxfp4 import MXFP4
from petals.formats.packed import set_dtype
from petals.loading import load_block, open_checkpoint
from petals.testing.swarm import running_swarm

GPT_OSS = GptOssConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"] * 2,
)
QWEN3_MOE = Qwen3MoeConfig(
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
FP4_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs output ORDER[j] of each eight at nibble j


def dequantized_by(fmt):
    """The format's own reading of a block's tensors, each packed weight dequantized (what
    ``--weights dequantized`` serves)."""

    def dequantize(tensors: dict, quantization_config: dict, dtype: torch.dtype) -> dict:
        fmt.check(quantization_config)
        return {
            name: value.dequantize() if isinstance(value, PackedWeight) else value
            for name, value in fmt.pack(tensors, quantization_config, dtype).items()
        }

    return dequantize


dequantize_gptq, dequantize_awq, dequantize_mxfp4 = map(dequantized_by, (GPTQ, AWQ, MXFP4))


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits → the int32 with the same bits."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


# --- MXFP4 -----------------------------------------------------------------------------------------


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' experts weight ``[experts, in, out]`` → (blocks, scales, dequantized) as GPT-OSS
    stores them: rows are outputs, groups of 32 inputs, each group's largest magnitude within 6 * 2**e."""
    rows = weight.transpose(1, 2)  # [experts, out, in]
    experts, outs, ins = rows.shape
    groups = rows.reshape(experts, outs, ins // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(-1)  # nearest FP4 value (ties: the first)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponent + 127).to(torch.uint8)
    dequantized = FP4_VALUES[codes] * torch.exp2(exponent)[..., None]
    return blocks, scales, dequantized.reshape(experts, outs, ins).transpose(1, 2).contiguous()


def save_mxfp4_checkpoint(path: Path) -> tuple[Path, Path]:
    source = save_random_model(GPT_OSS, path / "source")
    stored, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[f"{name}_blocks"], stored[f"{name}_scales"], dequantized[name] = quantize_mxfp4(tensor)
        else:
            stored[name], dequantized[name] = tensor.to(torch.bfloat16), tensor.to(torch.bfloat16).float()
    config_json = json.loads((source / "config.json").read_text())
    config_json["quantization_config"] = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    config_json["dtype"] = "bfloat16"
    return save_pair(path, "mxfp4", stored, dequantized, config_json, source)


def save_pair(path, name, stored, dequantized, config_json, source) -> tuple[Path, Path]:
    quantized, reference = path / name, path / "reference"
    save_by_layer(stored, quantized)
    (quantized / "config.json").write_text(json.dumps(config_json, indent=2))
    reference.mkdir()
    (reference / "config.json").write_text((source / "config.json").read_text())
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    return quantized, reference


# --- GPTQ and AWQ ----------------------------------------------------------------------------------


def quantize_int(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int, sym: bool):
    """``weight [out, in]`` → (q ``[in, out]``, zeros ``[groups, out]``, float16 scales ``[groups, out]``):
    min-max per group and output, ``w ≈ scale * (q - zero)``."""
    maxq = 2**bits - 1
    w = weight.T  # [in, out]
    scales = torch.empty(groups, w.shape[1])
    zeros = torch.empty(groups, w.shape[1], dtype=torch.int64)
    for g in range(groups):
        rows = w[g_idx == g]
        low, high = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        if sym:
            scales[g] = torch.maximum(-low, high).clamp(min=1e-8) * 2 / maxq
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = (high - low).clamp(min=1e-8) / maxq
            zeros[g] = torch.round(-low / scales[g]).long()
    scales = scales.to(torch.float16)
    q = torch.clamp(torch.round(w / scales.float()[g_idx]) + zeros[g_idx], 0, maxq).long()
    return q, zeros, scales


def dequantize_by_groups(q, zeros, scales, g_idx) -> torch.Tensor:
    """The specification's dequantization, one input row at a time → ``[out, in]`` float32."""
    rows = [scales[g_idx[i]].float() * (q[i] - zeros[g_idx[i]]).float() for i in range(q.shape[0])]
    return torch.stack(rows).T.contiguous()


def pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack ``32 / bits`` values a word along ``dim``, the j-th of each run (``order[j]`` if given) at bits j*bits."""
    per = 32 // bits
    values = values if dim == 0 else values.T
    runs = values.reshape(values.shape[0] // per, per, values.shape[1])
    words = sum(runs[:, (order[j] if order else j), :] << (bits * j) for j in range(per))
    words = to_int32(words)
    return (words if dim == 0 else words.T).contiguous()


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith("proj.weight") and tensor.ndim == 2


def save_int4_checkpoint(
    path: Path, method: str, bits: int = 4, desc_act: bool = False, sym: bool = True, config=None
):
    """A tiny Llama (or ``config``'s model) quantized with GPTQ or AWQ (group size 32) → (checkpoint,
    float32 reference). An MoE's experts are quantized one linear each, as the checkpoint stores them
    (``experts.N.gate_proj``, ...): transformers' conversion fuses them into 3-D experts at load."""
    source = save_random_model(config or tiny_config("llama"), path / "source")
    group_size = 32
    generator = torch.Generator().manual_seed(1)
    stored, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not is_quantized_linear(name, tensor):
            stored[name] = dequantized[name] = tensor
            continue
        prefix = name.removesuffix("weight")
        ins, groups = tensor.shape[1], tensor.shape[1] // group_size
        g_idx = torch.arange(ins) // group_size
        if desc_act:  # act order: groups follow a permutation of the inputs, g_idx says which
            g_idx = g_idx[torch.argsort(torch.randperm(ins, generator=generator))]
        q, zeros, scales = quantize_int(tensor, bits, g_idx, groups, sym=sym and method == "gptq")
        dequantized[name] = dequantize_by_groups(q, zeros, scales, g_idx)
        stored[prefix + "scales"] = scales
        if method == "gptq":
            stored[prefix + "qweight"] = pack(q, bits, dim=0)
            stored[prefix + "qzeros"] = pack((zeros - 1) & (2**bits - 1), bits, dim=1)  # v1: zero - 1
            stored[prefix + "g_idx"] = g_idx.to(torch.int32)
        else:
            stored[prefix + "qweight"] = pack(q, bits, dim=1, order=AWQ_ORDER)
            stored[prefix + "qzeros"] = pack(zeros, bits, dim=1, order=AWQ_ORDER)
    config_json = json.loads((source / "config.json").read_text())
    config_json["quantization_config"] = (
        {
            "bits": bits,
            "group_size": group_size,
            "damp_percent": 0.01,
            "desc_act": desc_act,
            "static_groups": False,
            "sym": sym,
            "true_sequential": True,
            "quant_method": "gptq",
            "checkpoint_format": "gptq",
        }
        if method == "gptq"
        else {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    )
    return save_pair(path, method, stored, dequantized, config_json, source)


LAYOUTS = {  # name: what builds it
    "mxfp4-gpt-oss": save_mxfp4_checkpoint,
    "gptq-4bit-sym": lambda path: save_int4_checkpoint(path, "gptq"),
    "gptq-4bit-act-order-asym": lambda path: save_int4_checkpoint(path, "gptq", desc_act=True, sym=False),
    "gptq-8bit": lambda path: save_int4_checkpoint(path, "gptq", bits=8),
    "awq-gemm": lambda path: save_int4_checkpoint(path, "awq"),
    # an MoE whose checkpoint stores every expert as linears of its own
    "gptq-4bit-qwen3-moe": lambda path: save_int4_checkpoint(path, "gptq", config=QWEN3_MOE),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(layout)`` → (quantized checkpoint, dequantized float32 reference)."""
    built: dict[str, tuple[Path, Path]] = {}

    def build(layout: str) -> tuple[Path, Path]:
        if layout not in built:
            built[layout] = LAYOUTS[layout](tmp_path_factory.mktemp(layout))
        return built[layout]

    return build


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_served_block_equals_the_dequantized_reference(checkpoint, layout):
    quantized, reference = checkpoint(layout)
    block = load_block(quantized, 2, torch.float32, weights="dequantized")
    packed = load_block(quantized, 2, torch.float32)

    expected = (
        AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).model.layers[2].state_dict()
    )
    assert block.state_dict().keys() == expected.keys()
    assert all(torch.equal(block.state_dict()[name], tensor) for name, tensor in expected.items())
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    diff = (block(hidden) - load_block(reference, 2, torch.float32)(hidden)).abs().max().item()
    assert diff <= 1e-5
    assert (packed(hidden) - block(hidden)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("layout", ["mxfp4-gpt-oss", "gptq-4bit-sym", "awq-gemm"])
def test_a_server_of_blocks_reads_only_their_tensors_and_their_companions(checkpoint, layout, monkeypatch):
    quantized, _ = checkpoint(layout)
    read: list[str] = []
    real_read = Checkpoint.read
    monkeypatch.setattr(
        Checkpoint,
        "read",
        lambda self, keys, *rest, **kw: read.extend(keys) or real_read(self, keys, *rest, **kw),
    )
    config = AutoDistributedConfig.from_pretrained(quantized)
    opened = open_checkpoint(quantized)

    for index in (1, 2):  # what a server of blocks 1:3 loads
        load_block(quantized, index, torch.float32, config=config, checkpoint=opened)

    served = {name for name in opened.weight_map if name.startswith(("model.layers.1.", "model.layers.2."))}
    assert set(read) == served
    assert {opened.weight_map[name] for name in read} == {
        "model-layer-1.safetensors",
        "model-layer-2.safetensors",
    }
    companion = "mlp.experts.down_proj_scales" if layout.startswith("mxfp4") else "mlp.down_proj.qzeros"
    assert f"model.layers.2.{companion}" in read


def test_mxfp4_weights_take_the_serving_dtype(checkpoint):
    block = load_block(
        checkpoint("mxfp4-gpt-oss")[0], 1, weights="dequantized"
    )  # the release's dtype: bfloat16
    assert {tensor.dtype for tensor in block.state_dict().values() if tensor.is_floating_point()} == {
        torch.bfloat16
    }
    expected = load_block(checkpoint("mxfp4-gpt-oss")[1], 1, torch.bfloat16).state_dict()
    assert all(torch.equal(block.state_dict()[name], tensor) for name, tensor in expected.items())


@pytest.mark.parametrize(
    ("layout", "quant_type"), [("gptq-4bit-sym", "int8"), ("awq-gemm", "nf4"), ("mxfp4-gpt-oss", "int8")]
)
def test_quant_type_quantizes_the_dequantized_weights_again(checkpoint, layout, quant_type):
    quantized, reference = checkpoint(layout)
    config = AutoDistributedConfig.from_pretrained(quantized)
    block = convert_block(
        load_block(quantized, 1, torch.float32),
        1,
        config,
        dtype=torch.float32,
        device="cpu",
        quant_type=quant_type,
    )
    assert {type(module).__name__ for module in block.modules()} >= {QUANTIZED_LINEAR[quant_type]}
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    expected_update = load_block(reference, 1, torch.float32)(hidden) - hidden
    error = (block(hidden) - hidden - expected_update).norm() / expected_update.norm()
    assert error < MAX_RELATIVE_ERROR[quant_type]


def test_gptq_v2_zeros_are_read_without_the_v1_offset():
    q = torch.randint(0, 16, (64, 8), generator=torch.Generator().manual_seed(0))
    zeros = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    scales = torch.rand(2, 8, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    g_idx = torch.arange(64) // 32
    tensors = {"o.qweight": pack(q, 4, dim=0), "o.qzeros": pack(zeros, 4, dim=1), "o.scales": scales}
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}
    weight = dequantize_gptq(tensors, config, torch.float32)["o.weight"]
    assert torch.equal(weight, dequantize_by_groups(q, zeros, scales, g_idx))


@pytest.mark.parametrize(
    ("method", "change", "message"),
    [
        ("gptq", {"bits": 3}, "gptq with 3 bits is not one petals reads"),
        ("gptq", {"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin' is not one petals reads"),
        ("gptq", {"group_size": 16}, r"do not match \(wrong bits or group_size"),
        ("awq", {"version": "gemv"}, "awq version 'gemv' is not one petals reads"),
        ("awq", {"zero_point": False}, "awq without zero points"),
    ],
)
def test_layouts_petals_does_not_read_are_refused_in_one_line(method, change, message):
    q = torch.zeros(64, 8, dtype=torch.int64)
    scales = torch.ones(2, 8, dtype=torch.float16)
    tensors = {
        "o.qweight": pack(q, 4, dim=0 if method == "gptq" else 1),
        "o.qzeros": pack(torch.zeros(2, 8, dtype=torch.int64), 4, dim=1),
        "o.scales": scales,
    }
    config = {"quant_method": method, "bits": 4, "group_size": 32, **change}
    dequantize = dequantize_gptq if method == "gptq" else dequantize_awq
    with pytest.raises(CheckpointFormatError, match=message) as error:
        dequantize(tensors, config, torch.float32)
    assert "\n" not in str(error.value)


def test_mxfp4_blocks_without_scales_are_refused():
    with pytest.raises(CheckpointFormatError, match="has no mlp.experts.down_proj_scales"):
        dequantize_mxfp4(
            {"mlp.experts.down_proj_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8)}, {}, torch.float32
        )


def test_transformers_reads_the_mxfp4_checkpoint_as_petals_does(checkpoint):
    """transformers' own MXFP4 loader (dequantize=True, on CPU) gets the same weights: the fixture's
    layout is GPT-OSS's, not only one petals agrees with itself about."""
    quantized, reference = checkpoint("mxfp4-gpt-oss")
    model = AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    for index in range(4):
        served = load_block(quantized, index, torch.float32, weights="dequantized").state_dict()
        assert all(
            torch.equal(served[name], tensor)
            for name, tensor in model.model.layers[index].state_dict().items()
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", ["mxfp4-gpt-oss", "gptq-4bit-act-order-asym", "awq-gemm", "gptq-4bit-qwen3-moe"]
)
def test_greedy_tokens_through_two_servers_equal_transformers(checkpoint, layout):
    quantized, reference = checkpoint(layout)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).generate(ids, **kwargs)
    if layout.startswith("mxfp4"):  # transformers itself loads this one on CPU: the same tokens
        own = AutoModelForCausalLM.from_pretrained(
            quantized, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
        ).generate(ids, **kwargs)
        assert torch.equal(own.sequences, expected.sequences)

    with running_swarm(quantized, "0:2", "2:4") as (dht, servers):
        method = layout.split("-")[0]
        for server in servers:
            assert "served packed on cpu: weights stay in their stored bytes" in server.log
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(  # GPT-OSS's release says bfloat16
            quantized, initial_peers=dht.initial_peers, dtype=torch.float32, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
        health = petals_health(dht.initial_peers)
    assert health.stdout.count(f"none ({method}") == 2, health.stdout + health.stderr
    assert health.stdout.count(" packed)") == 2, health.stdout + health.stderr
    assert torch.equal(output.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4


def test_the_log_says_how_a_quantized_checkpoints_weights_are_held():
    assert weights_note("gptq int4", "packed", torch.float16, "cpu", "none").startswith(
        "gptq int4 checkpoint served packed on cpu: weights stay in their stored bytes, dequantized to float16 "
        "per forward"
    )
    assert weights_note("awq int4", "dequantized", torch.float16, "cuda:0", "none") == (
        "awq int4 checkpoint dequantized to float16 as its blocks load (--weights dequantized: more memory, "
        "no per-forward dequantization)"
    )
    assert weights_note("mxfp4", "dequantized", torch.bfloat16, "cuda:0", "nf4") == (
        "mxfp4 checkpoint dequantized at load, then quantized again to nf4 (--quant_type)"
    )


@pytest.mark.slow
def test_a_server_quantizes_a_gptq_checkpoint_again_with_quant_type(checkpoint):
    quantized, reference = checkpoint("gptq-4bit-sym")
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(7))
    with running_swarm(quantized, "0:4", server_args=["--quant_type", "int8"]) as (dht, servers):
        assert "gptq int4 checkpoint dequantized at load, then quantized again to int8" in servers[0].log
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            quantized, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        logits = model(ids).logits
        model.close()
        health = petals_health(dht.initial_peers)
    assert "int8 (gptq int4 dequantized)" in health.stdout, health.stdout + health.stderr
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)(ids).logits
    assert (logits - expected).norm() / expected.norm() < MAX_RELATIVE_ERROR["int8"]


# --- 4-bit weights held for torch's CPU int4 kernel ------------------------------------------------

INT_LAYOUTS = sorted(layout for layout in LAYOUTS if not layout.startswith("mxfp4"))
KERNEL_CALLS = {  # per block 2 in bfloat16: every 4-bit linear, routed experts' too, each expert still packed
    "gptq-4bit-sym": 7,
    "gptq-4bit-act-order-asym": 7,
    "awq-gemm": 7,
    "gptq-4bit-qwen3-moe": 4 + 4 * 3,  # attention; each of the 4 experts hit: gate, up, down
    "gptq-8bit": 0,
}


def one_linear(method: str, rows: int, cols: int, desc_act: bool = False):
    """One ``[rows, cols]`` linear in groups of 32 as ``method`` stores it, with zero points of its own
    per group → (its stored tensors, its quantization_config, the specification's float32 weight)."""
    generator = torch.Generator().manual_seed(rows + cols)
    g_idx = torch.arange(cols) // 32
    if desc_act:
        g_idx = g_idx[torch.randperm(cols, generator=generator)]
    weight = torch.randn(rows, cols, generator=generator) * 0.02
    q, zeros, scales = quantize_int(weight, 4, g_idx, cols // 32, sym=False)
    config = {"quant_method": method, "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}
    if method == "gptq":
        stored = {"o.qweight": pack(q, 4, dim=0), "o.qzeros": pack(zeros, 4, dim=1), "o.g_idx": g_idx.int()}
    else:
        stored = {
            "o.qweight": pack(q, 4, dim=1, order=AWQ_ORDER),
            "o.qzeros": pack(zeros, 4, dim=1, order=AWQ_ORDER),
        }
    return {**stored, "o.scales": scales}, config, dequantize_by_groups(q, zeros, scales, g_idx)


def held(method: str, rows: int, cols: int, desc_act: bool = False):
    """``one_linear`` as the format holds it, served in bfloat16 → (the weight, the specification's)."""
    tensors, config, expected = one_linear(method, rows, cols, desc_act)
    weight = (GPTQ if method == "gptq" else AWQ).pack(tensors, config, torch.bfloat16)["o.weight"]
    return weight, expected


@pytest.mark.parametrize(
    ("method", "rows", "desc_act"),
    [("gptq", 80, False), ("gptq", 80, True), ("gptq", 192, True), ("awq", 64, False), ("awq", 144, False)],
)
def test_a_4_bit_weight_held_for_the_kernel_dequantizes_bit_for_bit_to_the_specifications(
    method, rows, desc_act
):
    weight, expected = held(method, rows, 128, desc_act)
    assert isinstance(weight, GroupedInt4Weight)
    assert (weight.order is not None) == desc_act  # act order: the inputs sorted by group
    assert torch.equal(weight.dequantize(), expected.to(torch.bfloat16))
    set_dtype(weight, torch.float32)
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize(("method", "desc_act"), [("gptq", False), ("gptq", True), ("awq", False)])
def test_bfloat16_inputs_go_through_the_kernel_within_bfloat16_error_of_the_dense_weight(method, desc_act):
    weight, _ = held(method, 64, 256, desc_act)
    dense = weight.dequantize()
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = F.linear(x, weight, bias)  # what every nn.Linear of a block calls
    assert [event.count for event in profile.key_averages() if "int4pack_mm" in event.key] == [1]
    reference = F.linear(x.float(), dense.float(), bias.float())
    dense_error = (F.linear(x, dense, bias).float() - reference).abs().max()
    kernel_error = (out.float() - reference).abs().max()
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 64)
    # the kernel rounds each group's scale and zero to bfloat16 where the dense path rounds each weight:
    # the same order of error, held to 3x the dense path's and 1% of the outputs' range (a misread
    # code, zero or permutation is off by the outputs' whole size)
    assert kernel_error <= max(3 * dense_error, 0.01 * reference.abs().max())
    assert torch.equal(weight.dequantize(), dense)  # the call left the stored fields as they were


def test_above_max_rows_float32_and_gradients_the_weight_is_dequantized_as_for_every_int4_format():
    weight, _ = held("gptq", 32, 64, desc_act=True)
    dense = weight.dequantize()
    many = torch.randn(int4pack.MAX_ROWS + 1, 64).to(torch.bfloat16)
    assert torch.equal(F.linear(many, weight), F.linear(many, dense))
    assert torch.equal(F.linear(many.float(), weight), F.linear(many.float(), dense.float()))
    trained = many[:2].clone().requires_grad_()
    out = F.linear(trained, weight)
    assert torch.equal(out, F.linear(trained, dense))
    out.sum().backward()
    assert trained.grad is not None


def test_weights_the_kernel_cannot_take_keep_their_stored_form():
    tensors, config, _ = one_linear("gptq", 24, 64)  # rows not a multiple of 16
    assert type(GPTQ.pack(tensors, config, torch.bfloat16)["o.weight"]) is GptqWeight
    tensors, config, _ = one_linear("gptq", 32, 64)
    config["group_size"], tensors["o.g_idx"] = 16, (torch.arange(64) // 16).int()  # groups of 16 inputs
    tensors["o.scales"] = tensors["o.scales"].repeat_interleave(2, dim=0)
    tensors["o.qzeros"] = tensors["o.qzeros"].repeat_interleave(2, dim=0)
    assert type(GPTQ.pack(tensors, config, torch.bfloat16)["o.weight"]) is GptqWeight
    tensors, config, _ = one_linear("gptq", 32, 64)
    tensors["o.g_idx"] = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)  # groups of unequal sizes
    assert type(GPTQ.pack(tensors, config, torch.bfloat16)["o.weight"]) is GptqWeight


@pytest.mark.parametrize("layout", INT_LAYOUTS)
def test_4_bit_weights_are_held_for_the_kernel_in_at_most_1_10x_the_stored_bytes(checkpoint, layout):
    quantized, _ = checkpoint(layout)
    config = AutoDistributedConfig.from_pretrained(quantized)
    opened = open_checkpoint(quantized)
    _, keys = opened.block_keys(config.block_prefix, 2)
    stored = sum(tensor.nbytes for tensor in opened.read(keys).values())
    block = load_block(quantized, 2, config=config, checkpoint=opened)  # the checkpoint's float32
    kinds = {
        type(module)
        for module in block.modules()
        if isinstance(module, (GroupedIntWeight, GroupedInt4Weight))
    }
    assert kinds == ({GptqWeight} if layout == "gptq-8bit" else {GroupedInt4Weight})
    assert block_weight_bytes(block) <= 1.10 * stored


@pytest.mark.parametrize("layout", INT_LAYOUTS)
def test_in_bfloat16_a_blocks_4_bit_linears_run_on_the_int4_kernel(checkpoint, layout):
    """Within bfloat16's rounding of the update the same block dequantized at load computes (a misread
    code, zero or permutation would be off by the whole update)."""
    quantized, _ = checkpoint(layout)
    packed = load_block(quantized, 2, torch.bfloat16)
    dense = load_block(quantized, 2, torch.bfloat16, weights="dequantized")
    # as small as the block's update: rounding a larger residual stream to bfloat16 would hide its error
    hidden = (torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    with (
        torch.inference_mode(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile,
    ):
        output = packed(hidden)
        expected = dense(hidden)
    kernel_calls = sum(event.count for event in profile.key_averages() if "int4pack_mm" in event.key)
    assert kernel_calls == KERNEL_CALLS[layout]
    update, expected_update = (output - hidden).float(), (expected - hidden).float()
    # bfloat16 roundings of scales, zeros and activations: 1.2% of the update's range here, held to 3%
    assert (update - expected_update).abs().max() <= 0.03 * expected_update.abs().max()
    assert kernel_calls == 0 or not torch.equal(output, expected)  # the kernel's own rounding: it did compute


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "seed"), [("gptq-4bit-sym", 19), ("gptq-4bit-act-order-asym", 55)])
def test_bfloat16_servers_on_the_int4_kernel_give_transformers_greedy_tokens(checkpoint, layout, seed):
    """The prompt is one where the float32 reference's top two logits stay 5% of the largest apart at
    every step, so equal tokens test the kernel's weights rather than rounding luck."""
    quantized, reference = checkpoint(layout)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(seed))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).generate(ids, **kwargs)
    top_two = [logits.topk(2).values[0] for logits in expected.logits]
    assert min(float((top[0] - top[1]) / top.abs().max()) for top in top_two) > 0.05

    server_args = ("--torch_dtype", "bfloat16")
    with running_swarm(quantized, "0:2", "2:4", server_args=server_args) as (dht, servers):
        for server in servers:
            assert "gptq int4 checkpoint served packed on cpu" in server.log
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            quantized, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 0.05 * max(logits.abs().max().item() for logits in expected.logits)
