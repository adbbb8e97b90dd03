"""petals-core installs beside what a machine already has: into an environment that holds torch and
transformers at the lower ends of petals-core's ranges, ``pip install petals-core petals-llama`` adds
what is missing and replaces neither (pip's own resolver, asked for a dry run)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEPT = ("torch", "transformers")  # what a GPU machine has installed for its other work


def lower_end(name: str) -> str:
    """The version ``constraints-oldest.txt`` (the lower ends, ``make test-oldest``) gives ``name``."""
    text = (ROOT / "constraints-oldest.txt").read_text()
    return re.search(rf"^{re.escape(name)}==(\S+)", text, re.MULTILINE).group(1)


def pip(python: Path, *args: str | Path) -> None:
    subprocess.run([python, "-m", "pip", "-q", *map(str, args)], check=True, timeout=600)


def test_installing_petals_keeps_the_torch_and_transformers_a_machine_has(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    held = {name: lower_end(name) for name in KEPT}
    pip(python, "install", "--no-deps", *(f"{name}=={version}" for name, version in held.items()))

    report = tmp_path / "report.json"
    pip(python, "install", "--dry-run", "--report", report, ROOT / "core", ROOT / "petals_llama")
    would_install = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert {"petals-core", "petals-llama", "hivemind"} <= set(would_install)
    replaced = {name: would_install[name] for name in KEPT if name in would_install}
    assert replaced == {}, f"pip would replace {replaced} installed as {held}"
