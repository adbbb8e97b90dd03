"""The conformance kit sizes what it allocates by what its checks run, in bytes: ``check_family`` on the
families' tiny configs stays well under 2 GiB, and ``check_structure`` on a real model's config (no weights,
no cache) under 1.5 GiB. Each is measured in a fresh process: its peak resident memory (``VmHWM``)."""

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig, DeepseekV3Config, KimiLinearConfig

from conftest import ROOT
from petals.block import cache_spec
from petals.kv_cache import LinearAttentionSpec, PageArena
from petals.plugins import get_plugin_manager
from petals.testing import check_structure
from petals.testing.conformance import _kit_spec, _pools_on_one_arena

GiB = 2**30

# the heaviest of the tiny configs, measured (peak RSS of check_family alone, 2 CPU cores, Dec 2026):
# qwen3_next 495 MiB, qwen3_5_moe_text 495 MiB, kimi_linear 494 MiB, falcon_h1 489 MiB; the lightest
# 450 MiB. All 40 take about 8 minutes in fresh processes, so the test runs the two heaviest kinds of state
# (a gated delta net beside attention, with experts; a KDA state beside latent attention) one after the
# other in one process (a minute): its peak is at least each one's. The families' own conformance tests
# run the kit on every family.
HEAVIEST = ["qwen3_next", "kimi_linear"]

PEAK = """
def peak():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
"""

TINY_FAMILIES = (
    PEAK
    + """
import json, sys, tempfile
from benchmarks.tiny_families import tiny_config
from petals.testing.conformance import check_family

for model_type in sys.argv[1:]:
    with tempfile.TemporaryDirectory() as workdir:
        check_family(tiny_config(model_type), workdir)
print(json.dumps({"peak": peak()}))
"""
)

REAL_CONFIGS = (
    PEAK
    + """
import json, sys, tempfile
import transformers
from petals.kv_cache import PageArena
from petals.testing import check_structure

def no_arena(*args, **kwargs):
    raise AssertionError("check_structure opened a cache arena")

PageArena.__init__ = no_arena  # every cache's memory is an arena's: a pool's, or a standalone cache's
reports = {}
for name in sys.argv[1:]:
    with tempfile.TemporaryDirectory() as workdir:
        report = check_structure(getattr(transformers, name)(), workdir)
    reports[name] = [report.model_type, len(report.cache_specs)]
print(json.dumps({"peak": peak(), "reports": reports}))
"""
)


def run_child(code: str, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_kit_on_the_heaviest_tiny_families_stays_under_2_gib():
    measured = run_child(TINY_FAMILIES, *HEAVIEST)
    assert measured["peak"] < 2 * GiB, f"peak RSS {measured['peak'] / GiB:.2f} GiB"


def test_the_structure_checks_on_real_configs_allocate_no_cache_and_stay_small():
    # transformers' default configs of these are the real models': DeepSeek V3 (61 blocks of width 7168),
    # Kimi Linear 48B (KDA states of 11 MiB a sequence with their snapshots), Qwen3-Next 80B
    names = ["DeepseekV3Config", "KimiLinearConfig", "Qwen3NextConfig"]
    measured = run_child(REAL_CONFIGS, *names)
    assert measured["reports"] == {
        "DeepseekV3Config": ["deepseek_v3", 61],
        "KimiLinearConfig": ["kimi_linear", 27],
        "Qwen3NextConfig": ["qwen3_next", 48],
    }
    assert measured["peak"] < 1.5 * GiB, f"peak RSS {measured['peak'] / GiB:.2f} GiB"


def kit_specs(config) -> list:
    distributed = get_plugin_manager().family(config.model_type).config_class.from_dict(config.to_dict())
    return [_kit_spec(cache_spec(distributed, index)) for index in range(config.num_hidden_layers)]


@pytest.mark.parametrize(
    ("config", "ceiling"),
    [(KimiLinearConfig(), 1.5 * GiB), (DeepseekV3Config(), GiB / 64)],
    ids=["kimi", "dsv3"],
)
def test_the_batching_checks_arena_holds_what_its_sessions_take(config, ceiling):
    # its sessions: 1, 2 and 1 sequences of at most 16 tokens. Kimi Linear's pages are its KDA state's (11 MiB
    # with its snapshots): 700 pages a block made 202 GiB; now 4 pages a state's block (a sequence's state
    # each) and 8 a latent one's (a page of its tokens, and one taken again after a rewind): 1.4 GiB, of which
    # the check touches what its tiny config's sessions write. DeepSeek V3's: 0.27 GiB before, 11 MiB now
    specs = kit_specs(config)
    arena, pools = _pools_on_one_arena(specs, [1, 2, 1], 16)
    states = sum(isinstance(getattr(spec, "state", spec), LinearAttentionSpec) for spec in specs)
    assert len(pools) == len(specs) and arena.free_pages == arena.num_pages
    assert arena.nbytes >= 4 * states * arena.page_nbytes
    assert arena.nbytes < ceiling, f"{arena.num_pages} pages of {arena.page_nbytes} bytes"


def test_the_structure_checks_pass_on_every_familys_default_config(tmp_path, monkeypatch):
    # transformers' default configs: most are the real models' sizes. Left out: gemma4_text's, which its
    # plugin refuses (per-layer inputs; the families report says so), and dots1's, whose experts transformers
    # itself cannot build (its default n_routed_experts is None)
    monkeypatch.setattr(PageArena, "__init__", no_arena)
    left_out = {"gemma4_text", "dots1"}
    for model_type in sorted(set(get_plugin_manager().model_families()) - left_out):
        report = check_structure(AutoConfig.for_model(model_type), tmp_path, folder_name=model_type)
        assert report.model_type == model_type and len(report.cache_specs) > 0


def no_arena(*args, **kwargs):
    raise AssertionError("check_structure opened a cache arena")
