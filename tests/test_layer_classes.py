"""A model whose decoder layers are of several classes is served: the block of layer i is the class
transformers builds for layer i.

OLMo Hybrid builds its attention layers and its gated-delta-net layers from two classes, chosen by each
layer's ``layer_types`` value. Its plugin names both (``block_classes``); the kit checks each block
against the layer transformers builds at that index, and two servers that each hold one layer of each
class generate transformers' greedy tokens.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, OlmoHybridConfig
from transformers.models.olmo_hybrid import modeling_olmo_hybrid as olmo_hybrid

import petals
from conftest import LOOPBACK_CLIENT, save_random_model, serving_only
from petals import hookimpl
from petals.block import RotaryBlockMixin, make_block
from petals.config import DistributedConfigMixin
from petals.kv_cache import FullAttentionSpec, LinearAttentionSpec
from petals.testing.conformance import check_family
from petals.testing.swarm import inprocess_swarm


class OlmoHybridAttentionBlock(RotaryBlockMixin, olmo_hybrid.OlmoHybridAttentionDecoderLayer):
    rotary_class = olmo_hybrid.OlmoHybridRotaryEmbedding


class OlmoHybridLinearBlock(RotaryBlockMixin, olmo_hybrid.OlmoHybridLinearAttentionDecoderLayer):
    rotary_class = olmo_hybrid.OlmoHybridRotaryEmbedding


class DistributedOlmoHybridConfig(DistributedConfigMixin, OlmoHybridConfig):
    block_class, attn_class, block_prefix = (
        OlmoHybridAttentionBlock,
        olmo_hybrid.OlmoHybridAttention,
        "model.layers",
    )
    block_classes = {"linear_attention": OlmoHybridLinearBlock}


class OnlyAttentionBlocks(DistributedOlmoHybridConfig):
    block_classes = {}


def _plugin(config_class):
    class Plugin:
        @hookimpl
        def register_model_families(self, register):
            register(config_class)

    return Plugin()


# the published pattern, shortened: gated delta nets with a full attention layer after them
TINY = OlmoHybridConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=32,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)  # fmt: skip


def test_each_block_is_the_class_transformers_builds_for_its_layer(tmp_path):
    with serving_only(_plugin(DistributedOlmoHybridConfig), name="olmo-hybrid-two-classes") as manager:
        config = manager.family("olmo_hybrid").config_class.from_dict(TINY.to_dict())
        with torch.device("meta"):
            built = [type(make_block(config, index)) for index in range(4)]
        assert built == [OlmoHybridLinearBlock, OlmoHybridAttentionBlock] * 2
        report = check_family(TINY, tmp_path)
    assert [type(spec) for spec in report.cache_specs] == [LinearAttentionSpec, FullAttentionSpec] * 2
    assert max(report.max_abs_diff.values()) <= 1e-5


def test_the_kit_names_a_layer_class_the_plugin_left_out(tmp_path):
    with serving_only(_plugin(OnlyAttentionBlocks), name="olmo-hybrid-one-class"):
        with pytest.raises(
            AssertionError, match="transformers builds layer 0 as a OlmoHybridLinear.*block_classes"
        ):
            check_family(TINY, tmp_path)


def test_two_servers_with_both_classes_generate_transformers_tokens(tmp_path):
    path = save_random_model(TINY, tmp_path / "OLMo-Hybrid-Tiny")
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().generate(ids, **kwargs)
    with serving_only(_plugin(DistributedOlmoHybridConfig), name="olmo-hybrid-two-classes"):
        with inprocess_swarm(path, "0:2", "2:4") as (dht, _):
            model = petals.AutoDistributedModelForCausalLM.from_pretrained(
                path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
            try:
                got = model.generate(ids, **kwargs)
            finally:
                model.close()
    assert torch.equal(got.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, expected.logits, strict=True))
    assert diff < 1e-4
