"""The demo on a real model: SmolLM2-135M-Instruct through three real servers."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch
from transformers import AutoTokenizer

import petals
from conftest import LOOPBACK_CLIENT, inprocess_swarm
from petals.cli.generate import encode
from petals.demo_model import prepare_demo_model
from petals.formats.gguf import local_model
from petals.testing.swarm import SwarmProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("petals-cache")
    prepare_demo_model(cache_dir)
    return cache_dir


@pytest.fixture(scope="module")
def demo_path(demo_cache):
    return prepare_demo_model(demo_cache)  # prepared already: the folder at once


def test_demo_answers_paris_and_leaves_nothing_behind(demo_cache):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "petals.cli",
            "demo",
            "--cache_dir",
            str(demo_cache),
            "--max_new_tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    answer = next(line for line in result.stdout.splitlines() if line.startswith("A: "))
    assert "Paris" in answer, result.stdout
    assert "blocks 20:30" in result.stdout and "Done." in result.stdout
    assert "first run only" not in result.stdout  # the model was prepared by the fixture
    leftovers = [
        p.info
        for p in psutil.process_iter(["pid", "cmdline"])
        if str(demo_cache) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []


def test_greedy_tokens_through_the_swarm_equal_local_generation(demo_path):
    path = demo_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = encode(tokenizer, "Name three colours of the rainbow.", chat=True)
    local = local_model(path, dtype=torch.float32)
    expected = local.generate(**inputs, max_new_tokens=24, do_sample=False)
    with inprocess_swarm(path, "0:10", "10:20", "20:30") as (dht, _):
        remote = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        try:
            got = remote.generate(**inputs, max_new_tokens=24, do_sample=False)
        finally:
            remote.remote_blocks.network.close()
    assert torch.equal(got, expected), (tokenizer.decode(got[0]), tokenizer.decode(expected[0]))


def test_demo_keep_starts_the_monitor_and_stops_everything_on_ctrl_c(demo_cache):
    demo = SwarmProcess(
        "petals demo --keep",
        ["petals.cli", "demo", "--keep", "--cache_dir", str(demo_cache), "--max_new_tokens", "2"],
    )
    children: list[psutil.Process] = []
    try:
        with demo:
            line = demo.wait_for(
                lambda: next((line for line in demo.stdout_lines if "Watch it at" in line), None),
                600,
                "the monitor",
            )
            children = psutil.Process(demo.pid).children(
                recursive=True
            )  # bootstrap, servers, monitor, daemons
            url = re.search(r"(http://\S+/)", line).group(1)
            with urllib.request.urlopen(url + "api/v1/state", timeout=30) as response:
                state = json.load(response)
            assert [model["state"] for model in state["model_reports"]] == ["healthy"]
            assert len(state["model_reports"][0]["server_rows"]) == 3
            assert any("petals generate" in line for line in demo.stdout_lines)
            stopped = time.monotonic()
            returncode = demo.stop(timeout=60)
            still_running = [child.cmdline() for child in children if child.is_running()]
            assert returncode == 0, (
                f"exit {returncode} {time.monotonic() - stopped:.0f} s after Ctrl-C; "
                f"still running: {still_running}\n" + "".join(demo.stdout_lines[-15:]) + demo.log
            )
        assert "Done." in "".join(demo.stdout_lines)
        assert [child.pid for child in children if child.is_running()] == []
    finally:
        for child in children:  # the demo's own processes, should it have failed to stop them
            if child.is_running():
                child.kill()
