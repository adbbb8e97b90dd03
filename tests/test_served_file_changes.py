"""A checkpoint file changed under a running server changes nothing it serves.

A server reads each tensor into memory of its own (``petals.checkpoint``, ``petals.formats.gguf``): had it
kept the file's memory map, a file overwritten in place would change the weights it computes with, and a
file cut short would kill it with SIGBUS at the next forward that touches a page past the new end. Here
three ``petals serve`` processes in one swarm serve a plain safetensors checkpoint, an FP8 one (served
packed) and a GGUF file, in float32: the safetensors checkpoints' own dtype, so that no conversion copies
their tensors and the loader's copy is all that stands between the server and the file (without it, the
dense and FP8 cases fail: tokens change after the overwrite, the server dies after the cut). Each file is
overwritten in place with another model's bytes (same inode), cut to half its length, and replaced by a
half-length copy; after each change a new client, reading its own pristine copy of the checkpoint,
generates the same greedy tokens as before, and the server is still running.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_gguf import write_tiny_llama_gguf
from test_weight_estimates import save_fp8_copy

import petals
from conftest import LOOPBACK_CLIENT, save_tiny_model
from petals.server.server import READY_MESSAGE
from petals.testing.swarm import start_dht, start_server

PROMPT = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(5))  # the GGUF has 256 tokens


def save_dense(path: Path, seed: int) -> Path:
    return save_tiny_model("llama", path, seed)


def save_fp8(path: Path, seed: int) -> Path:
    return save_fp8_copy(save_tiny_model("llama", path.parent / f"{path.name}-source", seed), path)


def save_gguf(path: Path, seed: int) -> Path:
    return write_tiny_llama_gguf(path, seed)


# format: (what writes a checkpoint of a seed at a path, its name, the served file a test changes in it)
FORMATS: dict[str, tuple[Callable[[Path, int], Path], str, str]] = {
    "dense": (save_dense, "tiny-llama", "model.safetensors"),
    "fp8": (save_fp8, "tiny-llama-fp8", "model-layer-1.safetensors"),  # one shard per layer: block 1's
    "gguf": (save_gguf, "tiny-llama.Q8_0.gguf", "."),  # the file itself
}


def overwrite_in_place(path: Path, other: Path) -> None:
    """Another model's bytes written into the same file (same inode, as a tool editing it in place)."""
    inode = path.stat().st_ino
    with open(path, "r+b") as file:
        file.write(other.read_bytes())
    assert path.stat().st_ino == inode


def truncate_to_half(path: Path, other: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def copy_half_over(path: Path, other: Path) -> None:
    """A half-length file copied over it (truncated to nothing, then written: an interrupted copy)."""
    half = path.with_name(path.name + ".half")
    half.write_bytes(other.read_bytes()[: other.stat().st_size // 2])
    shutil.copyfile(half, path)
    half.unlink()


CHANGES = (overwrite_in_place, truncate_to_half, copy_half_over)


@dataclass(frozen=True)
class Copies:
    """A checkpoint's copies: the client's, the server's, and the file of it a test changes, with the
    same file of another model."""

    pristine: Path
    served: Path
    changed: Path
    other: Path


def copies(root: Path, fmt: str) -> Copies:
    save, name, changed = FORMATS[fmt]
    pristine = save(root / "pristine" / name, seed=0)
    other = save(root / "other" / name, seed=1)
    served = root / "served" / name  # the same name: the same DHT prefix as the client's copy
    served.parent.mkdir(exist_ok=True)
    (shutil.copytree if pristine.is_dir() else shutil.copyfile)(pristine, served)
    return Copies(pristine, served, (served / changed).resolve(), (other / changed).resolve())


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """``(initial peers, {format: (its copies, its server)})``: one swarm serving every format, blocks
    0:4 each, from copies that tests may change."""
    root = tmp_path_factory.mktemp("file-changes")
    made = {fmt: copies(root, fmt) for fmt in FORMATS}
    with ExitStack() as stack:
        dht = stack.enter_context(start_dht())
        servers = {
            fmt: stack.enter_context(
                start_server(
                    made[fmt].served,
                    dht.initial_peers,
                    *("--block_indices", "0:4", "--torch_dtype", "float32"),
                    wait_ready=False,
                    wait_joined=False,
                    timeout=180,
                )
            )
            for fmt in FORMATS
        }
        for server in servers.values():
            server.wait_for_log(READY_MESSAGE, timeout=180)
        yield dht.initial_peers, {fmt: (made[fmt], servers[fmt]) for fmt in FORMATS}


def greedy_tokens(checkpoint: Path, initial_peers: list[str]) -> torch.Tensor:
    """A new client's greedy continuation of ``PROMPT`` through the swarm."""
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        checkpoint, initial_peers=initial_peers, **LOOPBACK_CLIENT
    )
    try:
        return model.generate(PROMPT, max_new_tokens=6, do_sample=False)
    finally:
        model.close()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_file_changed_under_a_server_changes_nothing_it_serves(swarm, fmt):
    initial_peers, served = swarm
    files, server = served[fmt]
    assert files.changed.read_bytes() != files.other.read_bytes()  # the other model's weights differ
    expected = greedy_tokens(files.pristine, initial_peers)
    for change in CHANGES:
        change(files.changed, files.other)
        assert greedy_tokens(files.pristine, initial_peers).tolist() == expected.tolist(), change.__name__
        assert server.process.poll() is None, f"{change.__name__}: {server.name} exited:\n{server.log}"
    assert "Traceback" not in server.log, server.log
