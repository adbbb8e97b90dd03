"""The GPU check (``python -m benchmarks.gpu``) in its CPU smoke mode: every section but the two that
reuse benchmarks tested elsewhere (latency, hops), at tiny sizes in float32, through real ``petals dht`` / ``petals serve`` processes and session
clients, so that it cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from conftest import ROOT


def test_smoke_mode_runs_every_section_and_leaves_no_process(tmp_path):
    record_path = tmp_path / "gpu.json"
    run = subprocess.run(
        # its models are made under tmp_path, so every process it starts names tmp_path
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--smoke",
            "--json",
            str(record_path),
            "--workdir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    record = json.loads(record_path.read_text())
    sections = record["sections"]
    assert list(sections) == ["correctness", "concurrency", "prefill", "memory", "profile"]
    assert not [name for name, section in sections.items() if "error" in section or "skipped" in section]
    correctness = sections["correctness"]
    assert correctness["passed"] and correctness["families"]["llama float32"]["tokens_equal"]
    # a linear-attention state and the indexed latent cache, served by a worker's in-process servers
    assert correctness["models"]["qwen3_5_text"]["cache_kinds"] == ["linear attention", "full attention"]
    assert correctness["models"]["glm_moe_dsa"]["cache_kinds"] == ["indexed attention"]
    assert all(
        correctness["families"][f"{name} float32"]["passed"] for name in ("qwen3_5_text", "glm_moe_dsa")
    )
    assert correctness["tensor_parallel"]["tokens_equal_to_one_shard"]
    assert sections["prefill"]["ratio"] > 0 and sections["concurrency"]["ratio_1"] > 0
    assert sections["profile"]["paged_read"]["calls_per_step"] > 0  # the gather was seen in the server
    assert record["table"] and record["table"][0] in run.stdout
    estimated = record["settings"]["estimated_seconds"]  # printed first, so a session sees what to expect
    assert list(estimated) == list(sections) and "estimated: correctness" in run.stdout
    leftovers = [
        process.pid
        for process in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in process.info["cmdline"] or [])
    ]
    assert not leftovers


def test_the_device_wheels_hold_the_plugin_of_every_model_type_the_check_serves():
    from benchmarks.gpu_device import own_distributions
    from benchmarks.tiny_families import CONFIGS
    from petals.plugins import get_plugin_manager

    distributions = own_distributions()
    assert all((ROOT / name / "pyproject.toml").is_file() for name in distributions)
    packed = {name.rsplit("/", 1)[-1] for name in distributions}
    families = get_plugin_manager().model_families()
    plugins = {families[name].config_class.__module__.split(".")[0] for name in CONFIGS if name in families}
    assert plugins <= packed
