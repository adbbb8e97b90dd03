"""A server plans how many blocks fit from ``estimate_block_weight_bytes`` (the config alone, on the meta
device); what it then holds is ``block_weight_bytes`` of each block it loads and converts. The two agree
within 3% for every served family with a tiny config, for every block (dense and MoE blocks differ), in
bfloat16, with ``--quant_type int8`` and ``nf4``, and served packed from an FP8 block-wise checkpoint
(gpt-oss from MXFP4, as it is published). ``--quant_type`` quantizes every weight matrix: what stays a
floating-point parameter of two or more dimensions is a router or no matrix at all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_formats import quantize_fp8, save_by_layer
from test_checkpoint_formats_int4 import quantize_mxfp4
from transformers import PretrainedConfig

from benchmarks.tiny_families import CONFIGS, tiny_config
from conftest import save_random_model
from petals.auto import AutoDistributedConfig
from petals.convert import block_weight_bytes, convert_block, estimate_block_weight_bytes
from petals.formats import StoredWeights
from petals.loading import load_block
from petals.plugins import get_plugin_manager

FAMILIES = sorted(CONFIGS.keys() & get_plugin_manager().model_families().keys())
QUANT_TYPES = {"bfloat16": "none", "int8": "int8", "nf4": "nf4", "packed": "none"}
TOLERANCE = 0.03
FP8_BLOCK = [128, 128]  # DeepSeek V3's weight_block_size
# checkpoint tensors a release keeps dense: MoE routers (Mixtral's and most families' gate, Llama 4's,
# PhiMoE's, gpt-oss's and Granite's router, Gemma 4's router projection)
CHECKPOINT_ROUTER = re.compile(r"\.gate\.weight$|\.router\.")
# block weights that stay as they are after --quant_type: routers, small and kept exact (float32 where
# transformers keeps them so: DeepSeek, GLM, dots1, Ernie, Kimi), by their names in the block ...
ROUTERS = {
    "mlp.gate.weight",
    "mlp.router.weight",
    "block_sparse_moe.router.weight",
    "feed_forward.router.weight",
    "router.proj.weight",
    "self_attn.indexer.weights_proj.weight",  # GLM-5's: transformers keeps it in float32, unquantized
}
# ... and what is no matrix: convolution kernels (Mamba, LFM2, gated delta nets, Kimi's short
# convolutions), gpt-oss's expert biases, score-correction biases, Kimi's per-head decay
NOT_MATRICES = re.compile(r"conv1d\.weight$|conv\.conv\.weight$|_bias$|\.A_log$")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny blocks quantize in milliseconds on one thread; on two, OpenMP's threads wait for each other
    on a busy machine (measured: 3-4 s for an MoE model's blocks, against 0.2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(model_type, packed)`` → a tiny random model of ``model_type``, saved once, or its
    packed copy (FP8 block-wise; gpt-oss: MXFP4)."""
    saved: dict[tuple[str, bool], Path] = {}

    def build(model_type: str, packed: bool) -> Path:
        if (model_type, packed) not in saved:
            if packed:
                source = build(model_type, False)
                write = save_mxfp4_copy if model_type == "gpt_oss" else save_fp8_copy
                target = tmp_path_factory.mktemp(f"{model_type}-packed") / "checkpoint"
                saved[model_type, packed] = write(source, target)
            else:
                path = tmp_path_factory.mktemp(model_type)
                saved[model_type, packed] = save_random_model(tiny_config(model_type), path)
        return saved[model_type, packed]

    return build


def save_fp8_copy(source: Path, path: Path) -> Path:
    """``source`` as a DeepSeek-style FP8 release stores it, one shard per layer in the new folder
    ``path``: every 2-D weight in the decoder layers as ``save_pretrained`` wrote it (per-expert linears
    included) in float8 with 128x128-block ``weight_scale_inv``; routers, norms and what lies outside the
    layers dense. Experts that the family's checkpoint keeps fused (3-D) stay dense too, named in
    ``modules_to_not_convert``: petals reads FP8 experts stored one matrix each."""
    config_json = json.loads((source / "config.json").read_text())
    layers = f"{AutoDistributedConfig.from_pretrained(source).block_prefix}."
    stored, fused_experts = {}, False
    for name, tensor in load_file(source / "model.safetensors").items():
        in_layers = name.startswith(layers)
        if in_layers and tensor.ndim == 2 and name.endswith(".weight") and not CHECKPOINT_ROUTER.search(name):
            stored[name], stored[f"{name}_scale_inv"] = quantize_fp8(tensor, FP8_BLOCK)
        else:
            stored[name] = tensor
            fused_experts |= in_layers and tensor.ndim == 3 and "conv" not in name
    config_json["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": FP8_BLOCK,
        "modules_to_not_convert": ["experts"] if fused_experts else None,
    }
    return _save(stored, config_json, path)


def save_mxfp4_copy(source: Path, path: Path) -> Path:
    """``source`` (gpt-oss) as OpenAI publishes it, in the new folder ``path``: the experts in MXFP4,
    everything else bfloat16."""
    stored = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[f"{name}_blocks"], stored[f"{name}_scales"], _ = quantize_mxfp4(tensor)
        else:
            stored[name] = tensor.to(torch.bfloat16)
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
    return _save(stored, config_json, path)


def _save(stored: dict[str, torch.Tensor], config_json: dict, path: Path) -> Path:
    save_by_layer(stored, path)
    (path / "config.json").write_text(json.dumps(config_json, indent=2))
    return path


def served_block(path: Path, config: PretrainedConfig, index: int, quant_type: str) -> torch.nn.Module:
    """Block ``index`` as a server's ``_load_blocks`` makes it: loaded in bfloat16, converted for CPU."""
    block = load_block(path, index, torch.bfloat16, config=config)
    return convert_block(block, index, config, dtype=torch.bfloat16, device="cpu", quant_type=quant_type)


def floating_matrices(block: torch.nn.Module) -> set[str]:
    """The names of the block's floating-point parameters of two or more dimensions."""
    return {
        name
        for name, parameter in block.named_parameters()
        if parameter.ndim >= 2 and parameter.is_floating_point()
    }


def kept_as_they_are(names: set[str]) -> set[str]:
    """Of ``names``, the routers and what is no matrix: what ``--quant_type`` keeps as it is."""
    return {name for name in names if name in ROUTERS or NOT_MATRICES.search(name)}


@pytest.mark.parametrize("variant", list(QUANT_TYPES))
@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_estimate_is_what_a_served_block_holds(checkpoints, model_type, variant):
    path = checkpoints(model_type, packed=variant == "packed")
    config = AutoDistributedConfig.from_pretrained(path)
    quant_type = QUANT_TYPES[variant]
    stored = StoredWeights.of(path, config) if variant == "packed" else None
    assert (stored is not None) == (variant == "packed")
    misses, wrongly_kept = {}, {}
    for index in range(config.num_hidden_layers):
        block = served_block(path, config, index, quant_type)
        measured = block_weight_bytes(block)
        estimated = estimate_block_weight_bytes(config, torch.bfloat16, quant_type, index, stored)
        print(f"{model_type} {variant} block {index}: estimated {estimated}, measured {measured}")
        if abs(estimated - measured) > TOLERANCE * measured:
            misses[index] = (estimated, measured)
        if quant_type != "none":
            loaded = floating_matrices(load_block(path, index, torch.bfloat16, config=config))
            if floating_matrices(block) != kept_as_they_are(loaded):
                wrongly_kept[index] = sorted(floating_matrices(block) ^ kept_as_they_are(loaded))
    assert not misses, f"block: (estimated, measured) bytes off by more than {TOLERANCE:.0%}: {misses}"
    # every matrix quantized; routers and convolutions kept exact (a convolution quantized as if it
    # were experts, or a router's own forward replaced by a quantized linear's, breaks the block)
    assert not wrongly_kept, f"--quant_type {quant_type}: quantized or kept wrongly, by block: {wrongly_kept}"
