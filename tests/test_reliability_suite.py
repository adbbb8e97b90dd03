"""The short version of ``make reliability`` runs in CI: no crash, no leak, no client error, and
``petals api`` answers 200 probes (malformed, valid, leaving) cleanly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parent.parent


def test_short_reliability_suite_meets_every_check(tmp_path):
    report_path = tmp_path / "reliability.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.reliability", "--short", "--json", str(report_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    report = json.loads(report_path.read_text())
    assert report["malformed"]["requests"] == 300 and not report["malformed"]["server_crashed"]
    assert sum(report["malformed"]["outcomes"].values()) == 300 + report["malformed"]["dht_records"]
    api = report["api"]
    assert api["requests"] == 200 and not api["api_crashed"]
    assert sum(api["outcomes"].values()) == 200  # every probe answered, the API up throughout
    assert report["checks"] and all(check["met"] for check in report["checks"])
