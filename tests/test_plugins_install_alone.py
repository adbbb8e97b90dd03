"""Each first-party plugin installs alone beside petals-core: pip resolves ``./core ./petals_x`` by
themselves (a dry run, offline, against this environment), and with only that plugin enabled and every
other first-party plugin unimportable, ``petals plugins`` lists it with exactly the model types it
registers beside all the others, and every module of its package imports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from test_install_ranges import ROOT, would_install

from petals.plugins import ALLOW_ENV, get_plugin_manager

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Distribution:
    folder: Path
    name: str  # the distribution, petals-gpt-oss
    plugin: str  # its entry point in the group "petals", gpt_oss
    package: str  # its import package, petals_gpt_oss


def first_party() -> list[Distribution]:
    found = []
    for pyproject in sorted(ROOT.glob("petals_*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        (plugin, target), *others = project["entry-points"]["petals"].items()
        assert others == [], f"{pyproject} registers more than one plugin"
        found.append(Distribution(pyproject.parent, project["name"], plugin, target.partition(".")[0]))
    return found


DISTRIBUTIONS = first_party()
EXAMPLE_PACKAGES = [path.parent.name for path in ROOT.glob("plugins/*/*/__init__.py")]

# Enables one plugin (ALLOW_ENV), makes the others' packages unimportable, runs `petals plugins` and then
# imports every module of the plugin's package (its lazily loaded blocks too).
ALONE = """
import importlib, importlib.abc, pkgutil, sys

package, blocked = sys.argv[1], set(sys.argv[2].split(","))


class BlockOtherPlugins(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{package} imports {name}, another first-party plugin")


sys.meta_path.insert(0, BlockOtherPlugins())
from petals.cli import main

main(["plugins"], standalone_mode=False)
for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
    importlib.import_module(module.name)
"""


def resolve_alone(distribution: Distribution, report: Path) -> dict[str, dict]:
    return would_install(
        Path(sys.executable), report, "--no-index", "--no-build-isolation", ROOT / "core", distribution.folder
    )


def run_alone(distribution: Distribution) -> subprocess.CompletedProcess:
    others = [d.package for d in DISTRIBUTIONS if d != distribution] + EXAMPLE_PACKAGES
    return subprocess.run(
        [sys.executable, "-c", ALONE, distribution.package, ",".join(others)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, ALLOW_ENV: distribution.plugin},
    )


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict[str, tuple[dict[str, dict], subprocess.CompletedProcess]]:
    """Per distribution: what pip would install and how ``petals plugins`` ran with it alone. The
    subprocesses of all of them run a few at a time (each mostly waits on imports and pip's builds)."""
    folder = tmp_path_factory.mktemp("alone")

    def both(distribution: Distribution):
        report = folder / f"{distribution.name}.json"
        return resolve_alone(distribution, report), run_alone(distribution)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = pool.map(both, DISTRIBUTIONS)
        return dict(zip((d.name for d in DISTRIBUTIONS), results, strict=True))


def test_these_are_the_distributions_make_installs():
    families = re.search(r"^FAMILIES := ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert sorted(d.folder.name for d in DISTRIBUTIONS) == sorted(
        families.group(1).replace("\\", " ").split()
    )


def test_a_plugin_whose_package_cannot_import_fails_to_load_there():
    llama = next(d for d in DISTRIBUTIONS if d.plugin == "llama")
    result = subprocess.run(
        [sys.executable, "-c", ALONE, llama.package, llama.package],  # blocks the plugin's own package
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, ALLOW_ENV: llama.plugin},
    )
    assert "llama\tFAILED TO LOAD" in result.stderr and result.returncode != 0, result.stderr


@pytest.mark.parametrize("distribution", DISTRIBUTIONS, ids=lambda d: d.name)
def test_the_plugin_installs_alone_and_lists_its_model_types(distribution, alone):
    would, listed = alone[distribution.name]
    # pip resolves petals-core and this plugin by themselves, needing no other first-party distribution
    assert set(would) == {"petals-core", distribution.name}
    needs = {Requirement(line).name for line in would[distribution.name].get("requires_dist", [])}
    assert needs & {d.name for d in DISTRIBUTIONS} == set(), needs
    assert "petals-core" in needs

    # alone, it loads, lists exactly the model types it registers among all the plugins, and imports
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "FAILED TO LOAD" not in listed.stderr, listed.stderr
    expected = sorted(
        family.model_type
        for family in get_plugin_manager().model_families().values()
        if family.plugin == distribution.plugin
    )
    assert expected, f"{distribution.name} registers no model type"
    version = would[distribution.name]["version"]
    assert listed.stdout.splitlines() == [
        f"{distribution.plugin}\t{distribution.name} {version}\tmodel types: {', '.join(expected)}"
    ]
