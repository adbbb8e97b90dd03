"""The benchmark suite runs end to end (``--quick``: tiny models, one run each, no timing claims)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parent.parent


def test_quick_suite_writes_a_result_with_a_ratio_per_benchmark_and_a_summary(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--results", str(tmp_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=1200,  # every benchmark starts real processes (wan_latency two swarms of 3); 8.5 min at load 13
    )
    assert result.returncode == 0, result.stdout + result.stderr

    records = [json.loads(path.read_text()) for path in tmp_path.glob("*.json")]
    # the six measurements of the suite's issue, the transport floor (g), the wide-area latency (h),
    # petals api's overhead (i), a private swarm's cost (p), speculative decoding (s), prompt tuning (t), the
    # simulated swarm of 1,000 servers (w), the cache's bytes per kind (k), DeepSeek's latent cache (l), the
    # sessions a cache budget holds (m), sessions needing more cache than a server has (n), a chat's later
    # turns continued (o), checkpoint formats served packed (q); (a) and (b) also at one torch thread
    # everywhere
    assert sorted(record["item"] for record in records) == [
        *"aabbcdefghi",
        "k",
        "l",
        "m",
        "n",
        "o",
        "p",
        "q",
        "s",
        "t",
        "w",
    ]
    for record in records:
        assert record["quick"] is True
        assert isinstance(record["ratio"], float) and record["ratio"] > 0
        assert record["checks"] or record["item"] == "g"  # the floor is a measurement with no goal
        assert record["met"] == all(check["met"] for check in record["checks"])
        assert {"cpu", "logical_cores", "torch", "transformers"} <= record["machine"].keys()
        assert record["command"].startswith("python -m benchmarks --quick")
    summary = (tmp_path / "summary.md").read_text()
    assert all(record["benchmark"] in summary for record in records)
    assert (tmp_path / "chart.png").read_bytes().startswith(b"\x89PNG")


def test_cache_kinds_hold_what_each_kind_keeps_and_no_more_than_transformers(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.cache_kinds", "--quick", "--results", str(tmp_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((tmp_path / "cache_kinds.json").read_text())
    held = {
        kind: {int(tokens): (counts["ours"], counts["hf"]) for tokens, counts in by_length.items()}
        for kind, by_length in record["measurements"].items()
    }
    # a sliding window of 4,096 (and a chunk of 8,192) stops growing once the sequence is past it
    sliding_past_window = {ours for tokens, (ours, _) in held["sliding"].items() if tokens >= 2 * 4_096}
    assert len(sliding_past_window) == 1, held["sliding"]
    assert held["chunked"][16_384][0] == held["chunked"][12_288][0]
    ours, theirs = held["sliding"][16_384]
    assert theirs < ours <= 1.05 * theirs  # transformers keeps 4,095 tokens, we keep a rewind margin more
    # DeepSeek V3's attention hands both caches its latent (512 + 64 values a token), not per-head keys
    assert held["keys != values"][16_384][1] == 16_384 * (512 + 64) * 4
    # full attention, keys and values of equal or unequal widths: to the byte, at every length
    for kind in ("full", "keys != values"):
        assert all(ours == theirs for ours, theirs in held[kind].values()), held[kind]
    assert record["met"], record["checks"]
    assert re.search(
        r"^  sliding window 4,096 \(Mistral\) +16,384 +[\d,]+ +[\d,]+ +1\.016$", result.stdout, re.M
    )
    assert ("linear attention (Qwen3-Next)" in result.stdout) != (
        "linear attention: not served by this build" in result.stdout
    )


def test_cache_budget_holds_as_many_sessions_as_pools_per_block_and_more_past_a_window(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.cache_budget", "--quick", "--results", str(tmp_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((tmp_path / "cache_budget.json").read_text())
    fits = {key: values["lengths"] for key, values in record["measurements"].items()}
    # full attention everywhere: the same pages either way
    assert all(data["arena"] == data["pools"] for data in fits["llama3"].values()), fits["llama3"]
    # past Gemma 3's window its sliding blocks hold what a window holds; the rest is the full blocks'
    assert fits["gemma3"]["8192"]["pools"] == 1 and fits["gemma3"]["8192"]["arena"] >= 3
    assert fits["gemma3"]["32768"] == {"arena": 1, "pools": 0, "hf": 1}
    assert all(data["arena"] >= data["pools"] for lengths in fits.values() for data in lengths.values())
    assert record["met"], record["checks"]
    assert re.search(r"^  Gemma 3 27B .* +8,192 +3 +1 +3 +3\.00 +1\.00$", result.stdout, re.M), result.stdout


def test_deepseek_latent_prints_bytes_per_token_and_times_three_equal_forms(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.deepseek_latent", "--quick", "--results", str(tmp_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((tmp_path / "deepseek_latent.json").read_text())
    # DeepSeek V3's sizes: 512 + 64 values a token (the plugin's spec) against 128 heads x (192 + 128)
    assert record["measurements"]["bytes_per_token"] == {
        "latent": {"torch.bfloat16": 576 * 2, "torch.float32": 576 * 4},
        "expanded": {"torch.bfloat16": 40_960 * 2, "torch.float32": 40_960 * 4},
    }
    assert re.search(r"^    expanded / latent: 71\.11x", result.stdout, re.M), result.stdout
    decode = record["measurements"]["decode"]
    assert sorted(map(int, decode)) == [32, 96]
    for previous, (length, row) in zip((0, 32), decode.items(), strict=True):
        assert row["max_abs_diff"] <= 1e-4
        assert set(row["seconds"]) == {"ours", "transformers", "expanded"}
        # the served block decodes absorbed, and prefills (32 tokens, then 64 more) expanded
        assert row["ours_paths"]["decode"] == "absorbed"
        assert list(row["ours_paths"]["prefill"]) == [f"expanded, {int(length) - previous} tokens"]
        # the served block's pages hold what transformers' latent holds; the expanded form 2 x (192 + 128)
        # values a token (the quick layer's 2 heads)
        assert row["bytes"]["ours"] == row["bytes"]["transformers"] == int(length) * 576 * 4
        assert row["bytes"]["expanded"] == int(length) * 2 * (192 + 128) * 4


def test_cpu_split_reports_each_process_of_the_swarm():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_split", "--quick", "--client_threads", "1"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    swarm, local = result.stdout.split("== local transformers")
    assert swarm.startswith("== swarm, client at 1 torch threads")
    for group in ("client   python", "server 0 python", "server 0 p2pd"):  # the server and its p2p daemon
        assert group in swarm, swarm
    assert "client   python" in local


def test_compute_floor_times_generate_its_layers_and_the_server_blocks():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.compute_floor", "--quick"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("quick-llama, 6 blocks"), result.stdout
    assert any("1 threads: transformers generate" in line and "the server's blocks" in line for line in lines)
    assert any("the same after 15 ms idle before each step" in line for line in lines), result.stdout
    assert any("with a busy process beside it" in line for line in lines), result.stdout
    assert any(line.startswith("  swarm before transport, servers at 1 threads") for line in lines)


@pytest.mark.parametrize("unpatched", [False, True])
def test_import_cost_lists_what_each_group_of_a_servers_imports_adds(unpatched):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.import_cost", *(["--unpatched"] if unpatched else [])],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"import patches: {'hivemind only' if unpatched else 'all'}"
    assert [line.split()[0] for line in lines[1:-1]] == [
        "interpreter,",
        "torch",
        "transformers",
        *(["sympy", "torch.distributed.tensor,"] if unpatched else []),
        "transformers'",
        "transformers.masking_utils",
        "modeling_llama",
        "hivemind",
        "petals",
        "total",
    ]
    compiler = "yes" if unpatched else "no"
    assert lines[-1] == (
        f"  imported: torch._dynamo.convert_frame {compiler}, scipy.optimize._optimize {compiler}, "
        f"sympy {compiler}, torch.distributed.tensor {compiler}"
    )


def test_suite_cpu_charges_each_process_to_its_kind_and_test_file(tmp_path):
    records = tmp_path / "processes.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", "--json", str(records)]
        + ["-q", "-p", "no:cacheprovider", "tests/test_cli_dht.py"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = result.stdout.split("== suite CPU:")[1]
    by_kind, by_file = report.split("== by kind of process")[1].split("== by test file")
    # the bootstrap peers the tests start, their daemons, and pytest itself
    for kind in ("petals dht", "p2pd", "pytest"):
        assert kind in by_kind, report
    assert "tests/test_cli_dht.py" in by_file, report
    run = json.loads(records.read_text())
    attributed = sum(process["cpu"] for process in run["processes"])
    assert 0 < attributed <= run["cpu_seconds"] + 0.5  # samples see less than the exact total, never more
    assert f"floor on {run['cores']} cores: {run['cpu_seconds'] / run['cores']:.1f} s" in report
    assert {process["test_file"] for process in run["processes"]} == {"", "tests/test_cli_dht.py"}


def test_the_summary_renders_the_suites_results_beside_the_gpu_checks_json(tmp_path):
    """``make bench`` ended in KeyError 'item' once benchmarks/results held gpu_nvidia_h200.json."""
    from benchmarks import report
    from benchmarks.harness import RESULTS_DIR

    for name in ("gpu_nvidia_h200.json", "latency_tiny_llama.json"):
        (tmp_path / name).write_text((RESULTS_DIR / name).read_text())
    text = report.render(tmp_path)
    assert [record["benchmark"] for record in report.load(tmp_path)] == ["latency_tiny_llama"]
    assert "| (a) latency_tiny_llama:" in text, text
    assert (tmp_path / "summary.md").is_file()
