"""``petals plugins --families``: transformers' causal-LM model types, served by which plugin or why not;
and the three-line plugin form that plugins/README.md documents, run through the kit as printed there."""

import importlib.util
import re
import subprocess
import sys
import types

import pytest
import torch
import transformers
from transformers import SeedOssConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from conftest import ROOT
from petals.families_report import family_rows
from petals.kv_cache import FullAttentionSpec
from petals.plugins import PluginManager, get_plugin_manager, using_plugin_manager
from petals.testing.conformance import check_family


def test_the_cli_lists_every_causal_lm_type_with_its_plugin_or_why_not():
    result = subprocess.run(
        [sys.executable, "-m", "petals.cli", "plugins", "--families"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # transformers' warnings about default configs are kept out
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:-1]}
    families = get_plugin_manager().model_families()
    assert set(rows) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(families)
    for model_type, family in families.items():
        assert rows[model_type].split()[1] == family.plugin, rows[model_type]
    # a type only its plugin knows (the template's placeholder) is named apart, not counted as served
    made_up = sorted(set(families) - set(CONFIG_MAPPING_NAMES))
    assert result.stdout.splitlines()[-1] == (
        f"{len(families) - len(made_up)} of {len(rows) - len(made_up)} transformers model types served by "
        "the installed plugins" + (f"; made up by a plugin: {', '.join(made_up)}" if made_up else "")
    )


def test_each_row_says_what_serves_it_or_why_nothing_does():
    rows = {row.model_type: row for row in family_rows()}
    # served, with the kinds of its default config's layers through the plugin's own cache_spec
    assert rows["gemma3_text"].plugin == "gemma"
    assert rows["gemma3_text"].cache_kinds == (
        "sliding attention (4096): 2,048 values/token",
        "full attention: 2,048 values/token",
    )
    assert rows["qwen3_next"].cache_kinds == (
        "linear attention: a fixed-size state",
        "full attention: 1,024 values/token",
    )
    assert rows["deepseek_v3"].cache_kinds == (
        "full attention: 576 values/token",
    )  # the latent, not 128 heads
    # the template's made-up type is marked as such; a real one is not
    assert (
        rows["petals_template"].made_up and "transformers has no such model" in rows["petals_template"].note
    )
    assert not rows["gemma3_text"].made_up
    # a multimodal wrapper is served as the text model it holds
    assert (
        rows["gemma3"].plugin is None
        and "served as its gemma3_text text model by gemma" in rows["gemma3"].note
    )
    # not served, and why: a layer kind core has no cache for; sizes only a plugin can give
    assert rows["lfm3"].note == "no plugin; core has no cache for its conv layers"
    assert "need their sizes from a plugin's cache_spec hook" in rows["mamba"].note
    assert rows["whisper"].note.startswith("the decoder of an encoder-decoder model")
    assert rows["roberta"].note.startswith("an encoder family")
    # a decoder whose layer kinds core caches: the three-line form is the way in
    assert rows["seed_oss"].plugin is None and "try the three-line plugin" in rows["seed_oss"].note


def test_a_default_config_its_plugin_refuses_shows_the_refusal():
    row = {row.model_type: row for row in family_rows()}["gemma4_text"]
    assert row.plugin == "gemma" and row.note.startswith("default config refused: UnservableConfigError")
    assert "hidden_size_per_layer_input" in row.note


def test_docs_families_md_is_what_its_script_writes():
    result = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "families.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def docs_script(name: str = "families") -> types.ModuleType:
    """``docs/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_tests_starting_petals_serve_processes_count_as_served_through_them():
    docs = docs_script()
    kit = docs.test_files(docs.KIT, docs.USES_KIT, helpers=True)
    servers = docs.test_files(docs.SERVERS, docs.STARTS_PROCESSES)
    # servers in the test's own process only: not through real `petals serve`
    assert "tests/test_server_swarm.py" not in servers
    assert "plugins/petals_qwen2/tests/test_qwen2_swarm.py" not in servers
    assert "tests/test_swarm_families.py" in servers and "tests/test_gemma3_gguf.py" in servers
    # a file whose servers for this type run in its own process (tensor-parallel BLOOM) does not count
    assert docs.naming(servers, "bloom") == []
    assert "tests/test_e2e_conversions.py" in docs.naming(servers, "mixtral")
    # the kit column: the files running check_family, their tiny configs in a helper module beside them
    assert docs.naming(kit, "qwen2") == ["plugins/petals_qwen2/tests/test_qwen2_conformance.py"]
    assert "tests/test_conformance.py" in docs.naming(kit, "llama")  # its configs are in tests/conftest.py


def three_line_plugin_from_the_guide() -> types.ModuleType:
    guide = (ROOT / "plugins" / "README.md").read_text()
    section = guide.split("## The three-line form", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("petals_seed_oss_from_the_guide")
    exec(compile(code, "plugins/README.md", "exec"), module.__dict__)
    return module


def test_the_guides_three_line_plugin_passes_the_kit(tmp_path):
    plugin = three_line_plugin_from_the_guide()
    config = SeedOssConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, num_hidden_layers=4, attention_bias=True,
    )  # fmt: skip
    manager = PluginManager()
    manager.register(plugin, name="seed-oss-from-the-guide")
    with using_plugin_manager(manager):
        report = check_family(config, tmp_path)
        assert {row.model_type: row.plugin for row in family_rows(manager)}[
            "seed_oss"
        ] == "seed-oss-from-the-guide"
    assert [type(spec) for spec in report.cache_specs] == [FullAttentionSpec] * 4
    assert report.cache_specs[0].bytes_per_token(torch.float32) == 2 * 2 * 16 * 4


def test_the_sweep_covers_every_causal_lm_type_of_this_transformers():
    sweep = docs_script("families_sweep")
    results = sweep.load_results()
    assert results["transformers"] == transformers.__version__
    assert set(results["types"]).isdisjoint(results["not_text_decoders"])
    assert set(results["types"]) | set(results["not_text_decoders"]) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert {entry["status"] for entry in results["types"].values()} <= {
        "exact",
        "refused",
        "broken",
        "untested",
    }


@pytest.mark.parametrize(
    "model_type",
    [
        "seed_oss",  # exact: the three-line form serves it
        "ctrl",  # refused by the generic plugin: its layer takes its cache as layer_past
        "deepseek_v32",  # refused by core: indexed attention, whose sizes only a plugin can give
        "gpt2",  # exact since the kit and the client give a step its positions (learned, added before the layers)
    ],
)
def test_the_sweeps_json_is_what_its_code_finds(model_type, tmp_path):
    sweep = docs_script("families_sweep")
    recorded = sweep.load_results()["types"][model_type]
    found = sweep.sweep_one(model_type, tmp_path)
    assert found["status"] == recorded["status"]
    assert found["reason"] == recorded["reason"]
    same = ("group", "layer_classes", "rotary", "attn_class", "block_prefix", "cache_kinds")
    assert {key: found.get(key) for key in same} == {key: recorded.get(key) for key in same}
    if found["status"] == "exact":
        assert found["max_abs_diff"] <= 1e-5
