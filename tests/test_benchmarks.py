"""The benchmark suite runs end to end (``--quick``: tiny models, one run each, no timing claims)."""

import json
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
        timeout=300,  # the speculative benchmark starts its own (wide-area) swarm
    )
    assert result.returncode == 0, result.stdout + result.stderr

    records = [json.loads(path.read_text()) for path in tmp_path.glob("*.json")]
    assert sorted(record["item"] for record in records) == [
        *"abcdef",
        "s",
    ]  # the six measurements, speculative decoding
    for record in records:
        assert record["quick"] is True
        assert isinstance(record["ratio"], float) and record["ratio"] > 0
        assert record["checks"] and record["met"] == all(check["met"] for check in record["checks"])
        assert {"cpu", "logical_cores", "torch", "transformers"} <= record["machine"].keys()
        assert record["command"].startswith("python -m benchmarks --quick")
    summary = (tmp_path / "summary.md").read_text()
    assert all(record["benchmark"] in summary for record in records)
    assert (tmp_path / "chart.png").read_bytes().startswith(b"\x89PNG")
