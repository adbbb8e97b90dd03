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


def would_install(python: Path, report: Path, *args: str | Path) -> dict[str, dict]:
    """What ``pip install --dry-run *args`` would install into ``python``'s environment: name -> metadata."""
    pip(python, "install", "--dry-run", "--report", report, *args)
    return {
        item["metadata"]["name"].lower(): item["metadata"]
        for item in json.loads(report.read_text())["install"]
    }


def test_installing_petals_keeps_the_torch_and_transformers_a_machine_has(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    held = {name: lower_end(name) for name in KEPT}
    pip(python, "install", "--no-deps", *(f"{name}=={version}" for name, version in held.items()))

    would = would_install(python, tmp_path / "report.json", ROOT / "core", ROOT / "petals_llama")
    assert {"petals-core", "petals-llama", "hivemind"} <= set(would)
    replaced = {name: would[name]["version"] for name in KEPT if name in would}
    assert replaced == {}, f"pip would replace {replaced} installed as {held}"
