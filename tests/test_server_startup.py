"""How ``petals serve`` starts: imports only what serving needs, pauses the cyclic GC until ONLINE."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys

from click.testing import CliRunner

from petals.cli import main
from petals.cli.run_server import collect_startup_garbage


def test_serve_help_imports_neither_torch_nor_hivemind():
    code = (
        "import sys; from petals.cli.run_server import serve_command; "
        "print(sorted({'torch', 'hivemind', 'transformers', 'yaml'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_serving_path_imports_no_optional_conversion_library(tiny_model_path):
    code = f"""
import sys, torch
from petals.server.planning import resolve_settings
from petals.convert import convert_block
from petals.loading import load_block
from petals.network.p2p import NetworkOptions
from petals.server.server import Server
block = load_block({str(tiny_model_path("llama"))!r}, 0, torch.float32)
convert_block(block, 0, block.config, dtype=torch.float32, device=torch.device("cpu"), quant_type="none")
print(sorted({{"bitsandbytes", "peft", "tensor_parallel"}} & set(sys.modules)))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_gc_runs_again_once_the_server_is_online():
    gc.disable()
    try:
        online = asyncio.Event()

        async def start() -> None:
            collecting = asyncio.create_task(collect_startup_garbage(online))
            await asyncio.sleep(0.01)
            assert not gc.isenabled()  # still starting
            online.set()
            await collecting

        asyncio.run(start())
        assert gc.isenabled()
    finally:
        gc.enable()


def test_serve_that_stops_early_leaves_gc_on(tiny_model_path):
    result = CliRunner().invoke(
        main, ["serve", str(tiny_model_path("llama")), "--num_blocks", "1", "--block_indices", "0:1"]
    )
    assert result.exit_code != 0
    assert gc.isenabled()
