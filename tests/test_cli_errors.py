"""Known failures of `petals serve / dht / generate / chat / api / tune` end in one `Error:` line (real processes).

Each case runs the real command line in its own process and checks the exit code (2: usage,
1: otherwise), that the last line says what to do, and that no traceback is printed unless the
log level is DEBUG. A missing optional package is made unimportable in that process only
(``sys.modules[name] = None``, which is how Python reports an absent package to ``import``).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import pytest

from petals.testing.swarm import InProcessDht

UNUSED_PEER_ID = "QmS9KwZptnVdB9FFV7uGgaTq4sEKBwcYeKZDfSpyKDUd1g"


def run_petals(
    *args: str, without: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``petals ARGS`` in a new process; ``without`` makes that package unimportable there."""
    hide = f"sys.modules[{without!r}] = None; " if without else ""
    code = f"import sys; {hide}from petals.cli import main; main(prog_name='petals')"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


@pytest.fixture(scope="module")
def busy_port():
    """A TCP port on 127.0.0.1 that another socket holds."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture(scope="module")
def closed_peer():
    """The multiaddr of a peer that is not running (a port nothing listens on)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{UNUSED_PEER_ID}"


@pytest.fixture(scope="module")
def empty_swarm():
    """A bootstrap peer with no servers."""
    with InProcessDht().start() as dht:
        yield dht.initial_peers[0]


def serve_args(model: str, *args: str) -> list[str]:
    return ["serve", model, "--loopback", "--new_swarm", "--torch_dtype", "float32", *args]


CLIENT_COMMANDS = ("generate", "chat", "api", "tune")
# a relative name that is no folder here: a repo id to transformers, which the tests' offline hub lacks
MISSING_MODEL = "no-such-org/no-such-model"


def client_args(command: str, model: str, f: dict, swarm: str | None = None) -> list[str]:
    """``petals COMMAND MODEL`` joining ``swarm`` (else a peer that is not running) on 127.0.0.1."""
    args = [command, model, "--initial_peers", swarm or f["closed_peer"], "--loopback"]
    extra = {"generate": ["hi"], "api": ["--port", "0"], "tune": ["--data", f["rows"], "--out", f["out"]]}
    return args + extra.get(command, [])


# (case, command line given the fixtures, exit code, what the one line says, package to hide)
CASES = [
    (
        "dht: port in use",
        lambda f: ["dht", "--loopback", "--port", str(f["port"])],
        1,
        "the port is in use",
        None,
    ),
    (
        "dht: unreachable bootstrap peer",
        lambda f: ["dht", "--loopback", "--initial_peers", f["closed_peer"]],
        1,
        "cannot reach any of the --initial_peers",
        None,
    ),
    (
        "serve: port in use",
        lambda f: serve_args(f["model"], "--num_blocks", "1", "--port", str(f["port"])),
        1,
        "the port is in use",
        None,
    ),
    (
        "serve: tensor parallelism without its package",
        lambda f: serve_args(f["model"], "--num_blocks", "1", "--tensor_parallel_devices", "cpu", "cpu"),
        1,
        "--tensor_parallel_devices needs the optional package tensor_parallel: pip install 'petals-core[tensor-parallel]'",
        "tensor_parallel",
    ),
    (
        "serve: quantization without its package",
        lambda f: serve_args(f["model"], "--num_blocks", "1", "--quant_type", "int8"),
        1,
        "--quant_type int8/nf4 needs the optional package bitsandbytes: pip install 'petals-core[quantization]'",
        "bitsandbytes",
    ),
    (
        "serve: nonexistent local model",
        lambda f: serve_args(f["missing_dir"], "--num_blocks", "1"),
        1,
        "no such directory",
        None,
    ),
    (
        "serve: nonexistent adapter directory",
        lambda f: serve_args(f["model"], "--num_blocks", "1", "--adapters", f["missing_dir"]),
        1,
        "adapter " + "{missing_dir}: no such directory",
        None,
    ),
    (
        "serve: more blocks than the model has",
        lambda f: serve_args(f["model"], "--num_blocks", "99"),
        2,
        "Invalid value for --num_blocks: 99 blocks asked, but the model has 4",
        None,
    ),
    (
        "generate: nonexistent local model",
        lambda f: ["generate", f["missing_dir"], "--initial_peers", f["closed_peer"], "--loopback", "hi"],
        1,
        "no such directory",
        None,
    ),
    *(
        (
            f"{command}: a folder without tokenizer",
            lambda f, command=command: client_args(command, f["model_without_tokenizer"], f),
            1,
            "{model_without_tokenizer} has no tokenizer (no tokenizer.json, tokenizer_config.json or other "
            "tokenizer files): pass --tokenizer PATH_OR_ID",
            None,
        )
        for command in CLIENT_COMMANDS
    ),
    (
        "generate: --tokenizer from another folder",  # gets as far as the swarm, which has no server
        lambda f: [
            *client_args("generate", f["model_without_tokenizer"], f, swarm=f["empty_swarm"]),
            "--tokenizer",
            f["model"],
        ],
        1,
        "no server for block",
        None,
    ),
    (
        "generate: --tokenizer without one",
        lambda f: [*client_args("generate", f["model"], f), "--tokenizer", f["model_without_tokenizer"]],
        1,
        "--tokenizer {model_without_tokenizer}: no tokenizer there",
        None,
    ),
    *(
        (
            f"{command}: a name that is neither a folder nor a model",
            lambda f, command=command: (
                serve_args(MISSING_MODEL, "--num_blocks", "1")
                if command == "serve"
                else client_args(command, MISSING_MODEL, f)
            ),
            1,
            f"model {MISSING_MODEL}: neither a local directory nor a model in the Hugging Face cache "
            "(HF_HUB_OFFLINE is set); give the path of a model's folder",
            None,
        )
        for command in (*CLIENT_COMMANDS, "serve")
    ),
    (
        "generate: verify is not a fraction",
        lambda f: ["generate", f["model"], "--initial_peers", f["closed_peer"], "--verify", "5", "hi"],
        2,
        "Invalid value for '--verify': 5.0 is not in the range 0.0<=x<=1.0",
        None,
    ),
    (
        "generate: no server hosts the blocks",
        lambda f: ["generate", f["model"], "--initial_peers", f["empty_swarm"], "--loopback", "hi"],
        1,
        "no server for block",
        None,
    ),
]


@pytest.fixture(scope="module")
def fixtures(
    tiny_model_with_tokenizer, tiny_model_path, busy_port, closed_peer, empty_swarm, tmp_path_factory
):
    missing = tmp_path_factory.mktemp("nothing") / "no-such-model"
    rows = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    rows.write_text('{"prompt": "hi", "completion": "w1"}\n')
    return {
        "model": str(tiny_model_with_tokenizer),
        "model_without_tokenizer": str(tiny_model_path("llama")),
        "rows": str(rows),
        "out": str(rows.with_name("prompts.safetensors")),
        "port": busy_port,
        "closed_peer": closed_peer,
        "empty_swarm": empty_swarm,
        "missing_dir": str(missing),
    }


@pytest.mark.parametrize(
    ("case", "args", "exit_code", "message", "without"), CASES, ids=[case[0] for case in CASES]
)
def test_known_failure_ends_in_one_error_line(fixtures, case, args, exit_code, message, without):
    command = args(fixtures)
    if command[0] == "api" and without is None and importlib.util.find_spec("fastapi") is None:
        pytest.skip(
            "petals api's extra is not installed here (the oldest lane): pip install 'petals-core[api]'"
        )
    result = run_petals(*command, without=without)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == exit_code, result.stderr
    assert lines[-1].startswith("Error: ") and message.format(**fixtures) in lines[-1], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("how", ["option", "environment"])
def test_debug_log_level_shows_the_traceback_too(fixtures, how):
    args = serve_args(fixtures["missing_dir"], "--num_blocks", "1")
    if how == "option":
        result = run_petals(*args, "--log_level", "DEBUG")
    else:
        result = run_petals(*args, env={"PETALS_LOG_LEVEL": "DEBUG"})
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "PetalsCliError" not in result.stderr.splitlines()[-1]
    assert result.stderr.strip().splitlines()[-1].startswith("Error: ")
