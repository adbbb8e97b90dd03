"""The template plugin installs, registers, and passes the conformance kit."""

from transformers import MistralConfig

from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules


def tiny_mistral() -> MistralConfig:
    return MistralConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        sliding_window=6,
    )


def test_template_is_installed_as_a_plugin():
    assert get_plugin_manager().family("mistral").plugin == "template"


def test_template_conforms(tmp_path):
    check_family(tiny_mistral(), tmp_path)


def test_template_prefix_rule_is_core_default():
    check_prefix_rules({"mistralai/Mistral-7B-v0.1": "Mistral-7B-v0-1"}, tiny_mistral())
