"""int8 and nf4 blocks: close to fp32 through prefill and cached steps, at a fraction of the memory.

Blocks are wider than the conftest ones (hidden 256) so that bitsandbytes' per-row and per-block
scales weigh what they weigh in real models. Relative errors are measured on the block's update
``y - x`` (the residual stream would hide them): ``‖Δy_quantized − Δy_fp32‖ / ‖Δy_fp32‖``.
Measured on these blocks: int8 ≈ 0.01, nf4 ≈ 0.14; bounds below leave headroom for other seeds.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import tiny_families
from conftest import LlamaFamilyPlugin, save_random_model, serving_only, tiny_config
from petals import hookimpl
from petals.block import allocate_cache
from petals.convert import block_weight_bytes, estimate_block_weight_bytes, quantize_block
from petals.convert.quantization import is_router
from petals.loading import load_block

MAX_RELATIVE_ERROR = {"int8": 0.03, "nf4": 0.25}
MAX_MEMORY_RATIO = {"int8": 0.55, "nf4": 0.3}


@pytest.fixture(scope="module")
def wide_block(tmp_path_factory):
    """``wide_block(variant)`` → block 0 of a one-layer fp32 model with hidden size 256."""
    blocks = {}

    def build(variant: str):
        if variant not in blocks:
            config = tiny_config(variant)
            config.update({"hidden_size": 256, "intermediate_size": 512, "head_dim": 64})
            config.update({"num_hidden_layers": 1, "vocab_size": 32})
            path = tmp_path_factory.mktemp(f"wide-{variant}")
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
            blocks[variant] = load_block(path, 0)
        return blocks[variant]

    return build


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
@pytest.mark.parametrize("variant", ["llama", "mixtral"])
def test_quantized_block_is_close_to_fp32_and_smaller(wide_block, variant, quant_type):
    reference = wide_block(variant)
    quantized = quantize_block(copy.deepcopy(reference), quant_type)

    ratio = block_weight_bytes(quantized) / block_weight_bytes(reference)
    print(f"{variant} {quant_type}: weight memory {ratio:.3f}x fp32")
    assert ratio <= MAX_MEMORY_RATIO[quant_type]
    unquantized = [name for name, p in quantized.named_parameters() if p.ndim >= 2 and p.is_floating_point()]
    assert unquantized == (
        ["mlp.gate.weight"] if variant == "mixtral" else []
    )  # the small router stays exact

    torch.manual_seed(1)
    caches = [allocate_cache(reference.config, 2, 16) for _ in range(2)]
    with torch.no_grad():
        for step, length in enumerate([7, 1, 1, 3]):
            hidden = torch.randn(2, length, 256)
            expected, got = reference(hidden, caches[0].view()), quantized(hidden, caches[1].view())
            error = ((got - expected).norm() / (expected - hidden).norm()).item()
            print(f"{variant} {quant_type} step {step} ({length} tokens): relative error {error:.4f}")
            assert error <= MAX_RELATIVE_ERROR[quant_type]


def test_unknown_quant_type_is_refused(wide_block):
    with pytest.raises(ValueError, match="'int3' is not a valid QuantType"):
        quantize_block(wide_block("llama"), "int3")


@pytest.mark.parametrize("quant_type", ["none", "int8", "nf4"])
@pytest.mark.parametrize("variant", ["llama", "mixtral"])
def test_weight_estimate_used_for_planning_matches_measurement(wide_block, variant, quant_type):
    block = wide_block(variant)
    measured = block_weight_bytes(quantize_block(copy.deepcopy(block), quant_type))
    assert estimate_block_weight_bytes(block.config, torch.float32, quant_type) == pytest.approx(
        measured, rel=0.03
    )


def kept_exact(block: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The routers, convolutions and GLM-5's indexer ``weights_proj`` (which transformers keeps in float32:
    the layer casts its input to that weight's dtype) of ``block``: what quantization leaves as it is."""
    return {
        name: module
        for name, module in block.named_modules()
        if is_router(module)
        or isinstance(module, torch.nn.modules.conv._ConvNd)
        or name.endswith("indexer.weights_proj")
    }


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
@pytest.mark.parametrize(
    "model_type",
    # routers that are linears with a forward of their own; convolutions of Mamba, LFM2, gated delta nets;
    # GLM-5's indexer, whose weights_proj transformers keeps in float32
    ["llama4_text", "phimoe", "falcon_h1", "lfm2", "qwen3_next", "glm_moe_dsa"],
)
def test_routers_and_convolutions_stay_as_they_are_and_every_block_runs(tmp_path, model_type, quant_type):
    path = save_random_model(tiny_families.tiny_config(model_type), tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny blocks: OpenMP's threads would only wait for each other
    kept_in_some_block = False
    try:
        for index in range(4):  # dense and MoE blocks, convolution and attention blocks
            reference = load_block(path, index, torch.float32)
            quantized = quantize_block(copy.deepcopy(reference), quant_type)
            assert kept_exact(reference).keys() == kept_exact(quantized).keys()
            kept_in_some_block |= bool(kept_exact(reference))
            for name, module in kept_exact(reference).items():
                kept = quantized.get_submodule(name)
                assert type(kept) is type(module) and all(
                    torch.equal(kept.state_dict()[key], value) for key, value in module.state_dict().items()
                ), name
            # no more tokens than GLM-5's indexer keeps (4): quantization noise would change which it keeps
            length = min(7, getattr(reference.config, "index_topk", 7))
            hidden = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(index))
            with torch.no_grad():
                expected, got = reference(hidden), quantized(hidden)
            error = ((got - expected).norm() / (expected - hidden).norm()).item()
            # tiny (hidden 64) blocks: nf4's error is far larger than on the wide ones above (up to 0.38;
            # 0.83 for GLM-5's latent attention, whose projections from 64 to 16-24 values nf4 coarsens
            # most): here nf4 is held to running and staying in range, its accuracy to the wide blocks
            assert error <= (MAX_RELATIVE_ERROR["int8"] if quant_type == "int8" else 1.0), (index, error)
    finally:
        torch.set_num_threads(threads)
    assert kept_in_some_block


class KeepAttentionInFullPrecision(LlamaFamilyPlugin):
    """A family may keep sensitive submodules unquantized by answering quantize_module with them."""

    @hookimpl
    def quantize_module(self, module):
        return module if type(module).__name__ == "LlamaAttention" else None


def test_quantize_module_hook_decides_for_whole_submodules(tiny_model_path):
    with serving_only(KeepAttentionInFullPrecision(), name="keep-attention"):
        block = quantize_block(load_block(tiny_model_path("llama"), 0, torch.float32), "int8")
    assert type(block.self_attn.q_proj) is torch.nn.Linear
    assert type(block.mlp.up_proj).__name__ == "Linear8bitLt"
