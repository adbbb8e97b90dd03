"""The served attention's absorbed form (``petals_deepseek.absorbed``): equal to transformers' expanded
one under every kind of mask the block can get, chosen for decode and not for prefill, and never used
where ``kv_b_proj`` is quantized or carries a LoRA adapter.

The kit runs (``test_deepseek_conformance.py``, ``test_deepseek_latent.py``) take both paths: decode
steps and short merged steps absorbed, prefills expanded; they see only sdpa's boolean masks.
"""

import copy

import pytest
import torch
from test_deepseek_conformance import CONFIGS
from test_deepseek_latent import REAL_WIDTHS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from petals.block import cache_spec
from petals.convert import quantize_block
from petals.kv_cache import manager_for, open_cache
from petals.plugins import get_plugin_manager
from petals_deepseek.absorbed import AbsorbedDeepseekV3Attention, absorption_pays

V3_WIDTHS = dict(rank=512, nope=128, rope=64, value=128)
TRANSFORMERS_ATTENTION = {"deepseek_v3": DeepseekV3Attention, "deepseek_v2": DeepseekV2Attention}


def served_block(config, index=1):
    config = get_plugin_manager().family(config.model_type).config_class.from_dict(config.to_dict())
    torch.manual_seed(0)
    block = config.block_class(config, index).eval()
    with torch.no_grad():  # the experts' weights are left uninitialized by the layer
        for parameter in block.parameters():
            parameter.normal_(0, 0.1)
    return block


def run_steps(block, steps=(7, 1, 1, 2, 1), batch=2, seed=1):
    """The block's outputs for a prefill then short steps, on a fresh cache."""
    spec = cache_spec(block.config, block.block_index)
    pool = manager_for(spec).make_pool(spec, 64, 4, torch.float32, "cpu")
    cache = open_cache(pool.spec, batch, 32, pool=pool, layer_index=block.block_index)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return [
            block(torch.randn(batch, tokens, block.config.hidden_size, generator=generator), cache.view())
            for tokens in steps
        ]


def test_absorption_is_chosen_for_decoding_and_short_steps_not_for_prefill():
    for context in (16, 512, 2_048, 8_192, 131_072):
        assert absorption_pays(1, context, **V3_WIDTHS)
        assert not absorption_pays(context, context, **V3_WIDTHS)  # a prefill: expand each token once
    # the break-even step length at 2,048 tokens of context (measured on the benchmark's layer: about 190)
    assert absorption_pays(128, 2_048, **V3_WIDTHS) and not absorption_pays(192, 2_048, **V3_WIDTHS)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_absorbed_equals_expanded_under_each_mask(implementation):
    config = copy.deepcopy(REAL_WIDTHS)
    config.num_attention_heads = config.num_key_value_heads = 4
    config._attn_implementation = implementation
    torch.manual_seed(0)
    attention = AbsorbedDeepseekV3Attention(config, 0).eval()
    weights = attention.absorbed_weights()
    batch, length, context = 2, 3, 11
    q_nope = torch.randn(batch, 4, length, 128)
    q_rot = torch.randn(batch, 4, length, 64)
    latent, k_rot = torch.randn(batch, 1, context, 512), torch.randn(batch, 1, context, 64)
    causal = torch.arange(context)[None, :] <= torch.arange(context - length, context)[:, None]
    padded = causal.expand(batch, 1, length, context).clone()
    padded[0, ..., :4] = False  # row 0 is a shorter session, left-padded in a merged step
    additive = torch.zeros(padded.shape).masked_fill(~padded, torch.finfo(torch.float32).min)
    # (mask given to the absorbed form, mask given to transformers' expanded form)
    masks = [(padded, padded), (additive, additive), (None, causal.expand(batch, 1, length, context))]
    if implementation == "eager":
        masks = [(additive, additive)]  # eager takes additive masks only
    with torch.no_grad():
        for absorbed_mask, expanded_mask in masks:
            absorbed = attention._absorbed_attention(q_nope, q_rot, latent, k_rot, absorbed_mask, *weights)
            expanded = attention._expanded_attention(q_nope, q_rot, latent, k_rot, expanded_mask)
            torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
        absorbed = attention._absorbed_attention(
            q_nope[:, :, :1], q_rot[:, :, :1], latent, k_rot, None, *weights
        )
        expanded = attention._expanded_attention(q_nope[:, :, :1], q_rot[:, :, :1], latent, k_rot, None)
        torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)  # a decode step, no mask


def test_bfloat16_scores_are_kept_in_float32():
    """In bfloat16 the absorbed form is about as close to float32's result as transformers' expanded one
    (1.2x as far over these seeds; with its scores rounded to bfloat16, 1.8x)."""
    config = copy.deepcopy(REAL_WIDTHS)
    config.num_attention_heads = config.num_key_value_heads = 8
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attention = AbsorbedDeepseekV3Attention(config, 0).eval()
    errors, reference_errors = [], []
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        shapes = [(2, 8, 1, 128), (2, 8, 1, 64), (2, 1, 300, 512), (2, 1, 300, 64)]
        inputs = [torch.randn(shape, generator=generator) for shape in shapes]
        half = [tensor.to(torch.bfloat16) for tensor in inputs]
        with torch.no_grad():
            exact = attention.float()._expanded_attention(*inputs, None)
            attention.to(torch.bfloat16)
            absorbed = attention._absorbed_attention(*half, None, *attention.absorbed_weights())
            expanded = attention._expanded_attention(*half, None)
        errors.append((absorbed.float() - exact).abs().max().item())
        reference_errors.append((expanded.float() - exact).abs().max().item())
    assert sum(errors) <= 1.5 * sum(reference_errors), (errors, reference_errors)


def test_per_head_weights_are_views_made_again_when_the_weights_move():
    block = served_block(CONFIGS["deepseek_v3"])
    run_steps(block)
    attention = block.self_attn
    w_uk, w_uv_t = attention.absorbed_weights()
    storage = attention.kv_b_proj.weight.untyped_storage().data_ptr()
    assert w_uk.untyped_storage().data_ptr() == w_uv_t.untyped_storage().data_ptr() == storage  # no copies
    assert attention.absorbed_weights()[0] is w_uk  # made once
    block.double()
    w_uk, _ = attention.absorbed_weights()
    assert w_uk.dtype == torch.float64
    assert w_uk.untyped_storage().data_ptr() == attention.kv_b_proj.weight.untyped_storage().data_ptr()


def run_as_transformers(block):
    """``run_steps`` with the block's attention retyped to transformers' own class for the run: its
    forward, on the same modules."""
    served = type(block.self_attn)
    block.self_attn.__class__ = TRANSFORMERS_ATTENTION[block.config.model_type]
    try:
        return run_steps(block)
    finally:
        block.self_attn.__class__ = served


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_lora_on_kv_b_proj_falls_back_to_transformers_and_elsewhere_absorbs(model_type):
    peft = pytest.importorskip("peft", reason="adapters need petals-core[adapters] (peft)")
    config = CONFIGS[model_type]
    block = served_block(config)
    expected = run_as_transformers(block)
    # absorbed: the same outputs within float32 rounding, not bit for bit
    assert max((a - b).abs().max().item() for a, b in zip(run_steps(block), expected, strict=True)) <= 1e-5

    torch.manual_seed(2)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["kv_b_proj"], init_lora_weights=False)
    peft.inject_adapter_in_model(lora, block, adapter_name="kv")
    assert block.self_attn.absorbed_weights() is None
    with_lora = run_steps(block)
    assert all(torch.equal(a, b) for a, b in zip(with_lora, run_as_transformers(block), strict=True))
    assert (
        max((a - b).abs().max().item() for a, b in zip(with_lora, expected, strict=True)) > 1e-3
    )  # the adapter acts

    other = served_block(config)
    peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, target_modules=["q_b_proj"], init_lora_weights=False), other, adapter_name="q"
    )
    assert other.self_attn.absorbed_weights() is not None  # LoRA on the queries: still absorbed


def test_a_quantized_kv_b_proj_falls_back_to_transformers():
    pytest.importorskip("bitsandbytes")
    block = quantize_block(served_block(CONFIGS["deepseek_v3"]), "int8")
    assert type(block.self_attn.kv_b_proj).__name__ == "Linear8bitLt"
    assert block.self_attn.absorbed_weights() is None
    outputs = run_steps(block)
    assert all(torch.equal(a, b) for a, b in zip(outputs, run_as_transformers(block), strict=True))
