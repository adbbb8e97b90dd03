"""The template plugin installs, registers its made-up model type, and passes the conformance kit."""

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import petals_template.block  # noqa: F401  registers the made-up model with transformers' auto classes
from petals.plugins import get_plugin_manager
from petals.testing import check_family, check_prefix_rules
from petals_template.config import TemplateConfig


def tiny_template() -> TemplateConfig:
    return TemplateConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        sliding_window=6,
    )


def test_template_is_installed_as_a_plugin_of_a_made_up_model_type():
    families = get_plugin_manager().model_families()
    assert families["petals_template"].plugin == "template"
    # the template must not claim a model type that transformers ships
    assert "petals_template" not in CONFIG_MAPPING_NAMES


def test_template_conforms(tmp_path):
    check_family(tiny_template(), tmp_path)


def test_template_prefix_rule_is_core_default():
    check_prefix_rules({"example-org/Template-7B-v0.1": "Template-7B-v0-1"}, tiny_template())
