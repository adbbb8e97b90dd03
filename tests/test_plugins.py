"""The plugin manager: discovery, allow/block lists, clear errors, in-test plugins, hygiene."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig

from conftest import tiny_config
from petals import hookimpl
from petals.auto import AutoDistributedConfig
from petals.config import DistributedConfigMixin, LazyClass
from petals.plugins import (
    DuplicateModelTypeError,
    PluginManager,
    UnknownModelTypeError,
    get_plugin_manager,
    using_plugin_manager,
)

FAMILIES = {
    "bloom": "bloom",
    "cohere": "cohere2",
    "deepseek": "deepseek_v2, deepseek_v3, kimi_linear",
    "dots": "dots1",
    "ernie": "ernie4_5_moe",
    "exaone": "exaone4",
    "falcon": "falcon, falcon_h1",
    "gemma": "gemma, gemma2, gemma3_text, gemma4_text",
    "glm": "glm4, glm4_moe, glm_moe_dsa",
    "gpt_oss": "gpt_oss",
    "granite": "granite, granitemoe",
    "lfm": "lfm2",
    "llama": "llama, llama4_text, smollm3",
    "minimax": "minimax_m2",
    "mistral": "ministral3, mistral",
    "mixtral": "mixtral",
    "olmo": "olmo2, olmo3, olmoe",
    "phi": "phi3, phimoe",
    "qwen": "qwen2_moe, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next",
}


def run_petals(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "petals.cli", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )


def test_petals_plugins_lists_installed_families_with_versions():
    result = run_petals("plugins", "--hooks")
    assert result.returncode == 0, result.stderr
    for name, model_type in FAMILIES.items():
        distribution = f"petals-{name.replace('_', '-')}"
        assert f"{name}\t{distribution} 0.1.0\tmodel types: {model_type}" in result.stdout
    hooks = {
        line.split("\t")[0]: lines[i + 1].strip().removeprefix("hooks: ").split(", ")
        for lines in [result.stdout.splitlines()]
        for i, line in enumerate(lines)
        if not line.startswith("\t")
    }
    assert all("register_model_families" in names for names in hooks.values())
    assert all(
        "dht_prefix" in hooks[name] for name in ("bloom", "llama", "mixtral")
    )  # Falcon's is the default
    assert "quantize_module" not in hooks["mixtral"]  # core quantizes fused experts itself
    assert "template\tpetals-template 0.1.0\tmodel types: petals_template" in result.stdout


def test_every_registered_family_config_carries_the_four_contract_names():
    """The seed's contract, on every family installed: ``block_class``, ``attn_class`` (the attention the
    default cache sizing reads), ``block_prefix`` and ``num_key_value_groups``."""
    families = get_plugin_manager().model_families()
    assert {family.plugin for family in families.values()} >= set(FAMILIES)  # all, not none
    lacking = {}
    for model_type, family in sorted(families.items()):
        config_class = family.config_class
        names = {
            "block_class": isinstance(config_class.block_class, type)
            and issubclass(config_class.block_class, torch.nn.Module),
            "attn_class": isinstance(config_class.attn_class, type)
            and issubclass(config_class.attn_class, torch.nn.Module),
            "block_prefix": isinstance(getattr(config_class, "block_prefix", None), str)
            and bool(config_class.block_prefix),
            "num_key_value_groups": isinstance(
                getattr(config_class, "num_key_value_groups", None), property | int
            ),
        }
        if missing := [name for name, carried in names.items() if not carried]:
            lacking[model_type] = missing
    assert lacking == {}


def test_no_plugins_gives_a_clear_error(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    result = run_petals("plugins", env={"PETALS_PLUGINS": ""})
    assert "No model-family plugins installed" in result.stdout
    script = f"from petals import AutoDistributedConfig as A; A.from_pretrained({str(tmp_path)!r})"
    failed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PETALS_PLUGINS": ""},
    )
    assert failed.returncode != 0
    # the plugins are installed, only not loaded: the error says which setting leaves each out
    assert "model type 'llama' has no loaded plugin; loaded: none; installed but not loaded:" in failed.stderr
    assert "'llama' (PETALS_PLUGINS does not name it)" in failed.stderr
    assert "change PETALS_DISABLE_PLUGINS / PETALS_PLUGINS" in failed.stderr and "pip install" not in failed.stderr


def test_blocked_plugin_names_the_remaining_ones(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    script = f"from petals import AutoDistributedConfig as A; A.from_pretrained({str(tmp_path)!r})"
    failed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PETALS_DISABLE_PLUGINS": "llama"},
    )
    assert (
        "model type 'llama' has no loaded plugin; loaded: bloom, cohere2, deepseek_v2, deepseek_v3, dots1, "
        "ernie4_5_moe, exaone4, falcon, falcon_h1, gemma, gemma2, gemma3_text, gemma4_text, glm4, glm4_moe, "
        "glm_moe_dsa, gpt_oss, granite, granitemoe, kimi_linear, lfm2, minimax_m2, ministral3, mistral, mixtral, "
        "olmo2, olmo3, olmoe, petals_template, phi3, phimoe, qwen2, qwen2_moe, qwen3, qwen3_5_moe_text, "
        "qwen3_5_text, qwen3_moe, "
        "qwen3_next; installed but not loaded: 'llama' (PETALS_DISABLE_PLUGINS names it)" in failed.stderr
    )


class TinyTestConfig(DistributedConfigMixin, LlamaConfig):
    model_type = "tiny-test"
    block_class = LazyClass("petals_llama.block:LlamaBlock")
    block_prefix = "model.layers"


class TinyTestPlugin:
    @hookimpl
    def register_model_families(self, register):
        register(TinyTestConfig)

    @hookimpl
    def dht_prefix(self, model_id):
        return f"tiny-{model_id}"


def test_in_test_plugin_for_a_new_model_type_is_dispatched(tmp_path):
    config = tiny_config("llama").to_dict() | {"model_type": "tiny-test"}
    (tmp_path / "model").mkdir()
    LlamaConfig.from_dict(config).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(
        (tmp_path / "model" / "config.json").read_text().replace('"llama"', '"tiny-test"')
    )
    manager = PluginManager()  # no entry points: only core's defaults and the test's plugin
    with using_plugin_manager(manager):
        with pytest.raises(
            UnknownModelTypeError, match="'tiny-test' has no installed plugin; installed: none"
        ):
            AutoDistributedConfig.from_pretrained(tmp_path / "model")
        manager.register(TinyTestPlugin(), name="tiny-test-plugin")
        loaded = AutoDistributedConfig.from_pretrained(tmp_path / "model")
    assert type(loaded) is TinyTestConfig
    assert loaded.dht_prefix == "tiny-model"


class OtherTestConfig(TinyTestConfig):
    model_type = "other-test"


class OtherTestPlugin:
    """Answers every family hook it implements, checking nothing: core must ask it for its own family only."""

    @hookimpl
    def register_model_families(self, register):
        register(OtherTestConfig)

    @hookimpl
    def dht_prefix(self, model_id):
        return f"other-{model_id}"

    @hookimpl
    def tensor_parallel_config(self):
        return "other-plan"


def test_each_family_gets_its_own_plugins_answers(tmp_path):
    manager = PluginManager()
    manager.register(TinyTestPlugin(), name="tiny-test-plugin")
    manager.register(
        OtherTestPlugin(), name="other-test-plugin"
    )  # registered last: pluggy would ask it first
    tiny, other = TinyTestConfig(), OtherTestConfig()
    assert manager.family_hooks(tiny).dht_prefix(model_id="m", config=tiny) == "tiny-m"
    assert manager.family_hooks(other).dht_prefix(model_id="m", config=other) == "other-m"
    assert manager.family_hooks(tiny).tensor_parallel_config(config=tiny, world_size=2) is None
    assert manager.family_hooks(other).tensor_parallel_config(config=other, world_size=2) == "other-plan"
    assert manager.family_hooks(None).dht_prefix(model_id="org/m.1", config=None) == "m-1"  # core's default


def test_two_plugins_claiming_one_model_type_is_an_error_naming_both():
    manager = PluginManager()
    manager.register(TinyTestPlugin(), name="first-plugin")
    manager.register(TinyTestPlugin(), name="second-plugin")
    with pytest.raises(
        DuplicateModelTypeError,
        match="'tiny-test' is claimed by two plugins: 'first-plugin' and 'second-plugin'",
    ):
        manager.model_families()


def test_plugin_that_fails_to_import_is_reported_and_others_still_load(tmp_path):
    (tmp_path / "broken_family.py").write_text("raise ImportError('needs a library that is not installed')\n")
    dist_info = tmp_path / "broken_family-9.9.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-family\nVersion: 9.9\n")
    (dist_info / "entry_points.txt").write_text("[petals]\nbroken = broken_family\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = run_petals("plugins", env=env)
    assert result.returncode == 0
    assert "broken\tFAILED TO LOAD: ImportError: needs a library that is not installed" in result.stderr
    assert "llama\tpetals-llama 0.1.0\tmodel types: llama" in result.stdout


def test_importing_petals_and_loading_plugins_is_lazy():
    script = textwrap.dedent(
        """
        import sys
        import petals
        assert "torch" not in sys.modules, "import petals imported torch"
        from petals.plugins import get_plugin_manager
        families = get_plugin_manager().model_families()
        assert {"bloom", "falcon", "llama", "mixtral"} <= set(families), families
        families = (
            "llama", "bloom", "falcon", "mixtral", "deepseek_v2", "deepseek_v3",
            "qwen3", "qwen3_moe", "qwen3_next", "qwen2_moe", "gemma", "gemma2", "gemma3", "gemma4", "mistral",
            "ministral3", "gpt_oss", "llama4", "smollm3", "glm4", "glm4_moe", "olmo2", "olmo3", "olmoe",
            "phi3", "phimoe", "granite", "granitemoe", "qwen3_5", "qwen3_5_moe", "cohere2", "exaone4",
            "ernie4_5_moe", "dots1", "minimax_m2", "lfm2", "falcon_h1", "kimi_linear", "glm_moe_dsa",
        )
        loaded = [m for m in sys.modules if any(m == f"transformers.models.{f}.modeling_{f}" for f in families)]
        assert not loaded, f"modeling code imported while loading plugins: {loaded}"
        print("lazy")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.stdout.strip() == "lazy", result.stderr


def test_core_names_no_model_family():
    core = os.path.join(os.path.dirname(__file__), os.pardir, "core")
    result = subprocess.run(
        [
            "grep",
            "-rniE",
            "llama|bloom|falcon|mixtral",
            "--include=*.py",
            "--include=*.toml",
            "--include=*.md",
            "--exclude-dir=*.egg-info",
            core,
        ],
        capture_output=True,
        text=True,
    )
    assert result.stdout == "", f"core names a family:\n{result.stdout}"
