"""``petals dht --log_period`` sets how often it logs its status; ``--refresh_period`` is its old name. Peers
that hold no blocks (``petals dht``, ``monitor``, ``health``) import neither torch nor numpy."""

import json
import subprocess
import sys
import time
import urllib.request

from click.testing import CliRunner

from conftest import imported_modules
from petals.cli.run_dht import dht_command
from petals.testing.swarm import start_dht, start_monitor

STATUS_LINE = "peers connected"  # the status line the period paces (the default period is 30 s)


def test_log_period_paces_the_status_lines():
    with start_dht("--new_swarm", "--log_period", "0.2") as dht:
        dht.wait_for_log(STATUS_LINE, timeout=20)
        assert "--refresh_period is deprecated" not in dht.log


def test_refresh_period_still_sets_the_log_period_and_says_it_is_deprecated():
    with start_dht("--new_swarm", "--refresh_period", "0.2") as dht:
        dht.wait_for_log("--refresh_period is deprecated", timeout=20)
        dht.wait_for_log(STATUS_LINE, timeout=20)


def test_help_shows_log_period_only_and_both_names_together_are_refused():
    runner = CliRunner()
    shown = runner.invoke(dht_command, ["--help"])
    assert shown.exit_code == 0 and "--log_period" in shown.output and "--refresh_period" not in shown.output
    both = runner.invoke(
        dht_command, ["--new_swarm", "--loopback", "--log_period", "1", "--refresh_period", "2"]
    )
    assert both.exit_code == 2
    assert "--log_period and --refresh_period are mutually exclusive" in both.output


def test_peers_without_blocks_import_neither_torch_nor_numpy(monkeypatch):
    """They read and serve DHT records only. Before hivemind's ``hivemind.utils`` and ``hivemind.dht``
    package ``__init__``\\ s were left out, a bootstrap peer imported torch: ready in 2.5 s instead of 0.7 s,
    with 196 MiB of PSS instead of 34 MiB besides its p2p daemon."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    with start_dht("--new_swarm") as dht, start_monitor(dht.initial_peers) as monitor:
        deadline = time.monotonic() + 60
        while True:  # until the monitor has read the swarm's (empty) model index once
            with urllib.request.urlopen(monitor.url + "api/v1/state", timeout=30) as response:
                state = json.load(response)
            if state["last_updated"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert state["last_updated"] and state["model_reports"] == []
        peers = [item for peer in dht.initial_peers for item in ("--initial_peers", peer)]
        health = subprocess.run(
            [sys.executable, "-m", "petals.cli", "health", *peers, "--loopback"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "No model is announced" in health.stdout, health.stderr[-2000:]
        logs = {"dht": dht.log_lines, "monitor": monitor.log_lines, "health": health.stderr.splitlines()}
    for name, lines in logs.items():
        modules = imported_modules(lines)
        assert "hivemind.dht.protocol" in modules, name  # the log holds its imports
        # a package imported by importlib.import_module is not logged itself, but its submodules are
        assert not [
            module for module in modules if module.split(".")[0] in {"torch", "numpy", "transformers"}
        ], name
