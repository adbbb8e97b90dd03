"""An operator's bad input ends in one line that names the file (tensor, block or key) and says what to do.

Each case damages a copy of the tiny Llama (its safetensors, or a GGUF file of it; or a flag, a config
file, an identity file, a port) the way an operator's disk, download or typo would, runs the real
``petals serve`` in its own process, and checks: a non-zero exit, the last line ``Error: ...`` with what
the case names, no traceback, and the model folder unchanged. What transformers accepts without
complaint (per-layer rotary frequencies of older checkpoints) is accepted too.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli_errors import run_petals, serve_args

from conftest import install_in_hf_cache
from petals.loading import load_block

WEIGHTS = "model.safetensors"
LAYER = "model.layers.0."


def folder_state(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def cut_in_half(folder: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def garbage_header(folder: Path) -> None:
    data = bytearray((folder / WEIGHTS).read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + length] = bytes([0xFF]) * length  # not UTF-8, not JSON
    (folder / WEIGHTS).write_bytes(bytes(data))


def garbage_length(folder: Path) -> None:
    data = bytearray((folder / WEIGHTS).read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    (folder / WEIGHTS).write_bytes(bytes(data))


def change_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        tensors = load_file(folder / WEIGHTS)
        change(tensors)
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})

    return damage


def transpose(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[LAYER + name] = tensors[LAYER + name].T.contiguous()

    return change


def drop(*names: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        for name in names:
            del tensors[LAYER + name]

    return change


def add_extra(tensors: dict[str, torch.Tensor]) -> None:
    tensors[LAYER + "mlp.extra_proj.weight"] = torch.zeros(4, 4)


def config_dtype(value: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.pop("torch_dtype", None)
        config["dtype"] = value
        (folder / "config.json").write_text(json.dumps(config))

    return damage


# (case, how the copy is damaged, what the last line names beyond the file)
DAMAGED_CHECKPOINTS = [
    ("safetensors cut in half", cut_in_half, "model.safetensors is not a readable safetensors file"),
    ("garbage header", garbage_header, "model.safetensors is not a readable safetensors file"),
    ("garbage header length", garbage_length, "model.safetensors is not a readable safetensors file"),
    (
        "k_proj transposed",
        change_tensors(transpose("self_attn.k_proj.weight")),
        "model.safetensors: block 0 does not match the model its config describes "
        "(self_attn.k_proj.weight is [64, 32], not [32, 64])",
    ),
    (
        "gate_proj transposed",
        change_tensors(transpose("mlp.gate_proj.weight")),
        "(mlp.gate_proj.weight is [64, 128], not [128, 64])",
    ),
    (
        "a block missing some tensors",
        change_tensors(drop("mlp.up_proj.weight", "input_layernorm.weight")),
        "model.safetensors: block 0 does not match the model its config describes (missing "
        "mlp.up_proj.weight; missing input_layernorm.weight)",
    ),
    ("a block with an extra tensor", change_tensors(add_extra), "(unexpected mlp.extra_proj.weight)"),
    (
        'dtype "float8" in config.json',
        config_dtype("float8"),
        "config.json's dtype 'float8' is not a torch dtype (such as float32, bfloat16, float16): fix config.json",
    ),
]


@pytest.fixture
def damaged_copy(tiny_model_path, tmp_path) -> Callable[[Callable[[Path], None]], Path]:
    def make(damage: Callable[[Path], None]) -> Path:
        folder = tmp_path / "model"
        shutil.copytree(tiny_model_path("llama"), folder)
        damage(folder)
        return folder

    return make


def assert_one_error_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0, result.stderr
    assert lines[-1].startswith("Error: "), result.stderr
    assert all(text in lines[-1] for text in expected), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return lines[-1]


@pytest.mark.parametrize(
    ("case", "damage", "message"), DAMAGED_CHECKPOINTS, ids=[c[0] for c in DAMAGED_CHECKPOINTS]
)
def test_a_damaged_checkpoint_ends_in_one_line_naming_the_file(damaged_copy, tmp_path, case, damage, message):
    folder = damaged_copy(damage)
    before = folder_state(folder)
    result = run_petals(
        *serve_args(str(folder), "--num_blocks", "2"), env={"PETALS_CACHE": str(tmp_path / "cache")}
    )
    assert_one_error_line(result, str(folder), message)
    assert folder_state(folder) == before


def gguf_cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def gguf_garbage_tensor_count(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:16] = struct.pack("<Q", 2**40)  # the header's tensor count, after the magic and the version
    path.write_bytes(bytes(data))


def gguf_garbage_metadata(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[24:4096] = bytes([0xFF]) * (4096 - 24)  # the metadata's keys and values, from the first one
    path.write_bytes(bytes(data))


# (case, how the file is damaged, what the last line says beyond the file and "download it again")
DAMAGED_GGUF_FILES = [
    ("GGUF file cut in half", gguf_cut_in_half, "bytes long, and its tensor data runs to byte"),
    ("GGUF tensor count of 2**40", gguf_garbage_tensor_count, "bytes long, and its metadata runs to byte"),
    ("GGUF metadata overwritten", gguf_garbage_metadata, "bytes long, and its metadata runs to byte"),
]


@pytest.mark.parametrize(
    ("case", "damage", "message"), DAMAGED_GGUF_FILES, ids=[c[0] for c in DAMAGED_GGUF_FILES]
)
def test_a_damaged_gguf_file_ends_in_one_line_naming_it(tmp_path, case, damage, message):
    """Where petals parses the file first (its config), not in a reshape of tensor data that names
    neither the file nor the cause, nor in transformers' "not a valid JSON file"."""
    from test_gguf import write_tiny_llama_gguf

    folder = tmp_path / "model"
    folder.mkdir()
    damage(write_tiny_llama_gguf(folder / "tiny-llama.Q8_0.gguf"))
    before = folder_state(folder)
    result = run_petals(*serve_args(str(folder / "tiny-llama.Q8_0.gguf"), "--num_blocks", "2"))
    line = assert_one_error_line(
        result, f"{folder / 'tiny-llama.Q8_0.gguf'} is not a readable GGUF file (it is ", message
    )
    assert "download it again" in line
    assert folder_state(folder) == before


def test_per_layer_rotary_frequencies_of_older_checkpoints_are_accepted(damaged_copy):
    """transformers loads them without complaint (the frequencies are computed, not loaded)."""

    def add_inv_freq(tensors: dict[str, torch.Tensor]) -> None:
        tensors[LAYER + "self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    folder = damaged_copy(change_tensors(add_inv_freq))
    block = load_block(folder, 0, torch.float32)
    assert "self_attn.rotary_emb.inv_freq" not in block.state_dict()


def test_a_hub_shard_changed_after_its_download_is_refused(tiny_model_path, offline_hf_cache):
    """A square tensor transposed keeps every shape: only the hub's checksum (a blob's name) tells."""
    snapshot = install_in_hf_cache(tiny_model_path("llama"), "tiny/llama", offline_hf_cache, as_blobs=True)
    load = (
        "import torch; from petals import load_block; load_block('tiny/llama', 0, torch.float32); print('ok')"
    )
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "ok", loaded.stderr
    tensors = load_file(snapshot / WEIGHTS)
    tensors[LAYER + "self_attn.q_proj.weight"] = tensors[LAYER + "self_attn.q_proj.weight"].T.contiguous()
    save_file(tensors, (snapshot / WEIGHTS).resolve(), metadata={"format": "pt"})  # same size, in place
    result = run_petals(*serve_args("tiny/llama", "--num_blocks", "2"))
    assert_one_error_line(result, "model.safetensors: its sha256 is not the hub's", "download it again")


def test_a_disabled_plugin_is_named_as_disabled(tiny_model_path):
    result = run_petals(
        *serve_args(str(tiny_model_path("llama")), "--num_blocks", "2"),
        env={"PETALS_DISABLE_PLUGINS": "llama"},
    )
    assert_one_error_line(
        result,
        "model type 'llama' has no loaded plugin",
        "not loaded: 'llama' (PETALS_DISABLE_PLUGINS names it)",
    )


def test_config_file_keys_are_checked_like_flags(tiny_model_path, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text('block_indicez: "0:1"\nfoo_bar: 42\n')
    result = run_petals(*serve_args(str(tiny_model_path("llama")), "-c", str(config)))
    assert result.returncode == 2, result.stderr
    assert "unknown option 'block_indicez' (did you mean block_indices?)" in result.stderr.splitlines()[-1]


def test_a_corrupt_identity_file_ends_in_one_line(tiny_model_path, tmp_path):
    identity = tmp_path / "identity.key"
    identity.write_bytes(b"\x08\x01\x12garbage" * 7)
    result = run_petals(
        *serve_args(str(tiny_model_path("llama")), "--num_blocks", "1", "--identity_path", str(identity))
    )
    assert_one_error_line(result, f"--identity_path {identity} holds no libp2p private key")


def test_one_port_serves_one_peer(tiny_model_path, free_port):
    """p2pd binds with SO_REUSEPORT: without the check, a second peer on a fixed port starts too."""
    first = subprocess.Popen(
        [sys.executable, "-m", "petals.cli", "dht", "--loopback", "--port", str(free_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in first.stdout:
            if "--initial_peers" in line or "initial_peers" in line:
                break
        else:
            pytest.fail("the first peer did not start")
        result = run_petals(
            *serve_args(str(tiny_model_path("llama")), "--num_blocks", "1", "--port", str(free_port))
        )
        assert_one_error_line(result, "the port is in use", f"port {free_port}")
    finally:
        first.terminate()
        first.wait(timeout=30)


@pytest.fixture
def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    time.sleep(0.1)
    return port
