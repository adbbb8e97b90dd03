"""deploy/: the systemd unit passes ``systemd-analyze verify``; the two Dockerfiles build images that
behave alike and as the README says. (Building and running the images: ``make image-test``.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from petals.server.throughput import default_cache_dir

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "petals-server.service"
DOCKERFILES = [DEPLOY / "Dockerfile.cpu", DEPLOY / "Dockerfile.cuda"]
RUNTIME_INSTRUCTIONS = ("ENV", "VOLUME", "USER", "WORKDIR", "EXPOSE", "STOPSIGNAL", "CMD", "ENTRYPOINT")


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the last stage, comments dropped and continued lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    instructions = [
        tuple(line.split(maxsplit=1))
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def runtime(dockerfile: Path) -> dict[str, str]:
    return {name: value for name, value in final_stage(dockerfile) if name in RUNTIME_INSTRUCTIONS}


def test_both_images_run_alike():
    cpu, cuda = (final_stage(path) for path in DOCKERFILES)
    assert cpu == cuda  # same user, volume, environment, stop signal, command: only the packages differ


def test_images_set_what_the_readme_and_petals_read():
    settings = runtime(DOCKERFILES[0])
    environment = dict(item.split("=", 1) for item in settings["ENV"].split())
    assert settings["STOPSIGNAL"] == "SIGTERM"
    assert settings["USER"] not in ("root", "0")
    assert settings["VOLUME"] == environment["PETALS_CACHE"] == "/cache"
    assert environment["HF_HOME"].startswith("/cache/")
    deployment = REPO.joinpath("README.md").read_text().partition("**Deployment**")[2].partition("\n## ")[0]
    for documented in ("PETALS_CACHE=/cache", "HF_HOME=/cache/huggingface", "STOPSIGNAL", "uid 1000"):
        assert documented in deployment, documented


def test_petals_keeps_its_caches_where_the_image_says(monkeypatch):
    environment = dict(item.split("=", 1) for item in runtime(DOCKERFILES[0])["ENV"].split())
    monkeypatch.setenv("PETALS_CACHE", environment["PETALS_CACHE"])
    assert default_cache_dir() == Path("/cache")


def verify_unit(root: Path, unit_text: str) -> subprocess.CompletedProcess:
    """``systemd-analyze verify`` in a scratch root laid out as the README's install leaves a host:
    the system's own units, this unit, and its ExecStart program (pip's ``petals`` script)."""
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system" / UNIT.name).write_text(unit_text)
    program = re.search(r"^ExecStart=(\S+)", unit_text, re.MULTILINE).group(1)
    (root / program.lstrip("/")).parent.mkdir(parents=True)
    shutil.copy2(Path(sys.executable).parent / "petals", root / program.lstrip("/"))
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", UNIT.name], capture_output=True, text=True, timeout=60
    )


needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or not Path("/usr/lib/systemd/system").is_dir(),
    reason="systemd-analyze is not installed: sudo apt-get install systemd (or make test as root)",
)


@needs_systemd
def test_service_unit_passes_systemd_analyze_verify(tmp_path):
    result = verify_unit(tmp_path, UNIT.read_text())
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@needs_systemd
def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path):
    result = verify_unit(tmp_path, UNIT.read_text().replace("KillMode=mixed", "KillMode=gently"))
    assert "Failed to parse kill mode" in result.stdout + result.stderr
