"""``petals demo`` needs the Llama plugin: without it, it says which one to install and starts nothing."""

import os
import subprocess
import sys


def test_demo_without_the_llama_plugin_names_the_plugin_to_install(tmp_path):
    cache_dir = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-m", "petals.cli", "demo", "--cache_dir", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PETALS_DISABLE_PLUGINS": "llama"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: petals demo runs SmolLM2-135M-Instruct, a 'llama' model, and no installed plugin "
        "serves that model type: pip install petals-llama"
    )
    assert "Traceback" not in result.stderr
    assert not cache_dir.exists()  # failed before preparing the model or starting any process
