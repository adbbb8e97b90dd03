"""Every server default lives in ``ServerSettings``: ``petals serve`` maps only the options given onto it."""

from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

from petals.cli.original_options import apply_original_options
from petals.cli.run_server import SETTING_OF_OPTION, requested_settings, serve_command
from petals.network.p2p import NetworkOptions
from petals.server.settings import SETTING_NAMES, ServerSettings, describe_default


def requested_by(*args: str) -> ServerSettings:
    """The settings ``petals serve ARGS`` asks for, before the server decides the open defaults."""
    options = serve_command.make_context("serve", list(args)).params
    model = apply_original_options(options.pop("model"), options)
    del options["metrics_host"], options["metrics_port"]
    return requested_settings(model, options)


def test_options_not_given_keep_the_settings_defaults(tiny_model_path):
    model = str(tiny_model_path("llama"))
    settings = requested_by(model, "--new_swarm")
    assert settings == ServerSettings(model, settings.network)
    parsed = serve_command.make_context("serve", [model]).params
    unset = {setting: parsed[option.name] for setting, option in serve_options().items()}
    assert unset == dict.fromkeys(unset, None) | {
        "skip_reachability_check": False,  # flags are off
        "tensor_parallel_devices": (),
        "adapters": (),
    }
    assert settings.network.startup_timeout == NetworkOptions.startup_timeout


def test_options_given_are_mapped_onto_their_settings(tiny_model_path):
    model = str(tiny_model_path("llama"))
    settings = requested_by(
        model,
        "--new_swarm",
        "--num_blocks=2",
        "--torch_dtype=float16",
        "--request-timeout=5",
        "--attn_cache_tokens=64",
        "--daemon_startup_timeout=7",
        "--backward_graph_budget=256MiB",
        "--adapters",
        model,
    )
    assert settings == dataclasses.replace(
        ServerSettings(model, settings.network),
        num_blocks=2,
        dtype="float16",
        request_timeout=5.0,
        attn_cache_tokens=64,
        backward_graph_budget=256 << 20,
        adapters=(model,),
    )
    assert settings.network.startup_timeout == 7


def test_a_word_list_takes_the_words_up_to_the_next_option():
    args = [
        "--adapters",
        "a",
        "b",
        "--tensor-parallel-devices=cpu",
        "cpu",
        "--num_blocks",
        "2",
        "--adapters",
        "c",
    ]
    given = serve_command.make_context("serve", ["model", *args]).params
    assert given["adapters"] == ("a", "b", "c")
    assert given["tensor_parallel_devices"] == ("cpu", "cpu")
    assert given["num_blocks"] == 2 and given["model"] == "model"
    with pytest.raises(click.UsageError, match="unexpected extra argument"):
        serve_command.make_context("serve", ["model", "--adapters", "a", "--", "b"])  # "--" ends the list


def serve_options() -> dict[str, click.Option]:
    """The ``petals serve`` options that set a ``ServerSettings`` field, by field name."""
    return {
        SETTING_OF_OPTION.get(option.name, option.name): option
        for option in serve_command.params
        if isinstance(option, click.Option)
        and SETTING_OF_OPTION.get(option.name, option.name) in SETTING_NAMES
    }


def test_every_setting_but_the_model_and_network_is_an_option():
    assert set(serve_options()) == SETTING_NAMES - {"model", "network"}


@pytest.mark.parametrize("setting", sorted(SETTING_NAMES - {"model", "network"}))
def test_help_shows_each_setting_default(setting):
    option = serve_options()[setting]
    _, help_text = option.get_help_record(click.Context(serve_command))
    default = describe_default(setting)
    if default is None:
        assert "default:" not in help_text
    else:
        assert f"[default: {default}" in help_text


def test_help_shows_the_rule_for_defaults_that_depend_on_the_model():
    help_text = " ".join(CliRunner().invoke(serve_command, ["--help"]).output.split())
    assert "[default: 180]" in help_text  # --request_timeout
    assert "16384 for models with grouped-query attention, else 4096" in help_text.replace("- ", "-")
