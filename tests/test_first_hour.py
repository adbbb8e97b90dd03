"""A newcomer's first hour, as the README tells it: the demo without root, the Python client on
127.0.0.1, and the smaller promises of the README's first sections."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import petals

ROOT = Path(__file__).resolve().parent.parent


def make(*args: str, **variables: str | Path) -> subprocess.CompletedProcess:
    """``make ARGS NAME=VALUE...`` in the repository."""
    assignments = [f"{name}={value}" for name, value in variables.items()]
    return subprocess.run(
        ["make", "--no-print-directory", *args, *assignments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_demo_installs_with_python_and_the_package_registries_alone(tmp_path):
    """``make demo`` on a fresh machine (a virtual environment not there yet) runs pip and the demo: no
    apt-get, no sudo, nothing that needs root; ``make test`` adds the tools its page and unit tests use."""
    demo = make("-n", "demo", VENV=tmp_path / "venv").stdout
    assert "pip install" in demo and demo.rstrip().endswith("petals demo"), demo
    for word in ("apt-get", "sudo", "chromium", "systemd", "test-tools"):
        assert word not in demo, demo
    assert "apt-get install" in make("-n", "test", VENV=tmp_path / "venv").stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged uid needs root")
def test_make_test_without_root_says_which_tools_it_leaves_out():
    """As an unprivileged user (uid 65534), ``make test``'s tool step installs nothing, says so in one
    line with the command, and lets the tests run (their Chromium and systemd tests then skip)."""
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        + ["make", "--no-print-directory", "test-tools", "CHROMIUM=no-such-chromium"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [
        "Not installing chromium (needs root and apt-get): the tests that use them skip; "
        "to run them: sudo apt-get install chromium"
    ]


def p2pd_arguments(model) -> list[str]:
    """The command line of the p2p daemon that ``model``'s client peer started (from /proc)."""
    child = model.remote_blocks.network.p2p._child
    return Path(f"/proc/{child.pid}/cmdline").read_bytes().decode().split("\0")


def test_loopback_keeps_a_python_client_on_127_0_0_1(tiny_llama_swarm):
    path, peers = tiny_llama_swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=peers, loopback=True)
    try:
        arguments = p2pd_arguments(model)
        for flag in ("-natPortMap=0", "-autonat=0", "-relay=0"):
            assert flag in arguments, arguments
        network = model.remote_blocks.network
        maddrs = network.run(network.p2p.get_visible_maddrs())
        assert maddrs and all(str(maddr).startswith("/ip4/127.0.0.1/") for maddr in maddrs), maddrs
        assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2).shape == (1, 5)
    finally:
        model.close()


def test_petals_testing_exports_the_loopback_options():
    from petals.network.client import LOOPBACK_CLIENT
    from petals.testing import LOOPBACK_CLIENT as exported

    assert exported is LOOPBACK_CLIENT
    assert "LOOPBACK_CLIENT" in petals.testing.__doc__


def test_petals_simulate_prints_its_table_without_json(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "petals.cli",
            "simulate",
            "--servers",
            "12",
            "--blocks",
            "6",
            "--hours",
            "0.25",
        ]
        + ["--clients", "3", "--policy", "ours"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "latency" in result.stdout and list(tmp_path.iterdir()) == [], result.stdout


def test_the_install_section_lists_every_extra_the_errors_name():
    """Each extra an error message tells a user to install is in the README's Install section."""
    import re

    install = (ROOT / "README.md").read_text().partition("\n## Install\n")[2].partition("\n## ")[0]
    named = set()
    for path in (ROOT / "core/petals").rglob("*.py"):
        named.update(re.findall(r"petals-core\[([a-z-]+)\]", path.read_text()))
    assert {"simulate", "api", "monitor", "quantization"} <= named
    missing = sorted(extra for extra in named if f"./core[{extra}]" not in install)
    assert missing == [], missing


def test_petals_simulate_plot_without_matplotlib_names_the_extra_before_simulating(tmp_path):
    """``--plot`` needs the ``simulate`` extra: without matplotlib, one line says which, before any work."""
    hide_matplotlib = (
        "import importlib.util as util; found = util.find_spec; "
        "util.find_spec = lambda name, *args: None if name == 'matplotlib' else found(name, *args); "
        "from petals.cli import main; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_matplotlib, "simulate", "--servers", "12", "--blocks", "6"]
        + ["--hours", "0.25", "--plot", str(tmp_path / "plot.png")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "Error: --plot needs matplotlib: pip install 'petals-core[simulate]' (or leave out --plot)"
    ], result.stderr
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
