"""Write docs/families.md: the model types the first-party plugins serve (plugin, cache kinds, the tests
that check each), those the example plugins in ``plugins/`` serve, then every other causal-LM model type
transformers knows and why it is not served; and the README's table of the families, one row per
first-party distribution, between its ``<!-- families:start -->`` and ``<!-- families:end -->`` lines.

    python docs/families.py          # rewrite docs/families.md and the README's table
    python docs/families.py --check  # exit 1 if either is not what this writes

The rows come from ``petals.families_report`` (what ``petals plugins --families`` prints) over the
installed plugins; what the conformance kit made of each text-only causal-LM type with the generic plugin
(the three-line form made from transformers' own code: served exactly, refused, broken) from
``docs/families_sweep.json``, which ``python docs/families_sweep.py`` writes. A model type's tests are the test files naming its transformers config class or its
quoted model type (or importing a helper module beside them that does): those running the conformance
kit (``check_family``), and those starting real ``petals serve`` processes (servers running inside the
test's own process do not count).
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from collections import Counter
from pathlib import Path

import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from petals.families_report import FamilyRow, family_rows
from petals.plugins import get_plugin_manager

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "families.md"
README = ROOT / "README.md"
README_START, README_END = "<!-- families:start -->", "<!-- families:end -->"
SWEEP = ROOT / "docs" / "families_sweep.json"
KIT = ["petals_*/tests/*.py", "plugins/*/tests/*.py", "tests/test_conformance.py"]
SERVERS = [
    "tests/test_swarm*.py", "tests/test_server_swarm.py", "tests/test_e2e_*.py", "tests/test_gguf.py",
    "tests/test_gemma3_gguf.py", "tests/test_client_failover.py", "plugins/*/tests/*swarm*.py",
]  # fmt: skip
USES_KIT = re.compile(r"\bcheck_family\(")
STARTS_PROCESSES = re.compile(
    r"\b(running_swarm|swarm_with_processes|start_server)\(|\"petals\.cli\", \"demo\""
)
# model types a file names whose servers it runs only in its own process, beside real processes for others
IN_PROCESS_THERE = {"tests/test_e2e_conversions.py": {"bloom"}}  # its tensor-parallel servers


def test_files(patterns: list[str], uses: re.Pattern, helpers: bool = False) -> dict[str, str]:
    """The files matching ``patterns`` whose text ``uses`` matches: name -> their text, with ``helpers``
    that of the modules beside them they import (the kit's tiny configs: ``from qwen2_tiny import ...``)."""
    files = sorted({path for pattern in patterns for path in ROOT.glob(pattern)})
    found = {}
    for path in files:
        text = path.read_text()
        if uses.search(text):
            imported = re.findall(r"^from (\w+) import", text, re.MULTILINE) if helpers else []
            beside = [path.parent / f"{name}.py" for name in imported]
            text += "".join(module.read_text() for module in beside if module.exists())
            found[str(path.relative_to(ROOT))] = text
    return found


def naming(files: dict[str, str], model_type: str) -> list[str]:
    config_class = CONFIG_MAPPING_NAMES.get(model_type)
    names = [re.escape(f'"{model_type}"')] + ([rf"\b{config_class}\b"] if config_class else [])
    pattern = re.compile("|".join(names))
    return [
        name
        for name, text in files.items()
        if pattern.search(text) and model_type not in IN_PROCESS_THERE.get(name, ())
    ]


def cell(paths: list[str]) -> str:
    return ", ".join(f"`{path}`" for path in paths) or "-"


def distributions(folders: str) -> dict[str, str]:
    """Plugin (entry-point name) -> distribution, of the ``pyproject.toml`` files in ``folders``."""
    found = {}
    for pyproject in sorted(ROOT.glob(f"{folders}/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        for plugin in project.get("entry-points", {}).get("petals", {}):
            found[plugin] = project["name"]
    return found


def page(rows: list[FamilyRow], kit: dict[str, str], servers: dict[str, str], sweep: dict) -> str:
    first_party, examples = distributions("petals_*"), distributions("plugins/*")
    others = [row for row in rows if row.plugin is None]
    swept = sweep.get("types", {})
    lines = [
        "# Model families",
        "",
        "Written by `python docs/families.py` (checked by `tests/test_families_report.py`); "
        "`petals plugins --families` prints the same rows for the plugins installed where it runs. "
        "Cache kinds are those of the model type's default config (transformers' defaults), through "
        "the serving plugin's `cache_spec`; a plugin may serve kinds its type's default config does not "
        "use (LFM2's default config has attention in every layer; `petals-lfm` also serves its "
        "convolution layers). The tests of a type are those naming it: the ones running the conformance "
        "kit, and the ones starting real `petals serve` processes (not servers in the test's own process). "
        f"Model types from transformers {transformers.__version__}.",
        "",
        "## The generic plugin on every text-only causal-LM type",
        "",
        *sweep_summary(sweep),
    ]
    for title, plugins in (
        ("the first-party plugins", first_party),
        ("the example plugins in `plugins/`", examples),
    ):
        served = [row for row in rows if row.plugin in plugins]
        lines += [
            "",
            f"## Served by {title} ({len(served)} model types)",
            "",
            "| model type | plugin | cache kinds (default config) | conformance kit | through real `petals serve` "
            "| the generic plugin alone |",
            "|---|---|---|---|---|---|",
        ]
        for row in served:
            kinds = ", ".join(row.cache_kinds) or row.note
            if row.made_up:
                kinds += f"; {row.note}"
            lines.append(
                f"| `{row.model_type}` | {plugins[row.plugin]} | {kinds} | {cell(naming(kit, row.model_type))} "
                f"| {cell(naming(servers, row.model_type))} | {sweep_cell(swept.get(row.model_type), short=True)} |"
            )
    lines += [
        "",
        f"## Not served by a plugin ({len(others)} model types of transformers' causal-LM mapping)",
        "",
        "| model type | cache kinds | the generic plugin (the kit), or why it is not swept |",
        "|---|---|---|",
    ]
    lines += [
        f"| `{row.model_type}` | {', '.join(row.cache_kinds) or '-'} "
        f"| {sweep_cell(swept[row.model_type]) if row.model_type in swept else row.note} |"
        for row in others
    ]
    return "\n".join(lines) + "\n"


def sweep_cell(entry: dict | None, short: bool = False) -> str:
    """A type's result with the generic plugin, for a table cell."""
    if entry is None:
        return "-"
    if entry["status"] == "exact":
        return (
            "exact"
            if short
            else f"served exactly by the generic plugin (max \\|diff\\| {entry['max_abs_diff']:.1e})"
        )
    finding = f" Found: {entry['finding']}" if entry.get("finding") else ""
    return f"{entry['status']}: {entry['reason']}{finding}".replace("|", "\\|")


def sweep_counts(sweep: dict) -> tuple[Counter, int]:
    """Types per status, and how many types were swept."""
    counts = Counter(entry["status"] for entry in sweep.get("types", {}).values())
    return counts, sum(counts.values())


def sweep_headline(sweep: dict) -> str:
    counts, swept = sweep_counts(sweep)
    others = ", ".join(
        f"{counts[status]} {status}" for status in ("refused", "broken", "untested") if counts[status]
    )
    return (
        f"{counts['exact']} of {swept} text-only causal-LM types of transformers {sweep.get('transformers')} are "
        f"served exactly by the generic plugin, the three-line form of `plugins/README.md` made from "
        f"transformers' own code ([docs/families_sweep.json](docs/families_sweep.json), swept {sweep.get('date')}); "
        f"{others}"
    )


def refused_groups(sweep: dict) -> list[tuple[str, list[str]]]:
    """The refused types by reason, the most common reason first."""
    groups: dict[str, list[str]] = {}
    for model_type, entry in sweep.get("types", {}).items():
        if entry["status"] == "refused":
            groups.setdefault(entry.get("group") or entry["reason"], []).append(model_type)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))


def sweep_summary(sweep: dict) -> list[str]:
    if not sweep.get("types"):
        return ["Not swept yet: run `python docs/families_sweep.py`."]
    swept = sweep["types"]
    seconds = sum(entry.get("seconds", 0) for entry in swept.values())
    lines = [
        f"{sweep_headline(sweep).replace('(docs/families_sweep.json)', '(families_sweep.json)')}. The kit ran each type on a tiny config of it (`petals.testing.generic`), "
        f"in {seconds / 60:.0f} minutes in all; {len(sweep.get('not_text_decoders', {}))} types of the mapping "
        "are no text-only decoder and not swept (encoders, decoders of encoder-decoder models, multimodal "
        "wrappers: the last are swept as their text model). Refused, by reason:",
        "",
    ]
    lines += [f"- {group} ({len(types)}): {_types(types)}" for group, types in refused_groups(sweep)]
    for status in ("broken", "untested"):
        found = {model_type: entry for model_type, entry in swept.items() if entry["status"] == status}
        if found:
            lines += ["", f"{status.capitalize()} ({len(found)}):", ""]
            lines += [f"- `{model_type}`: {sweep_cell(entry)}" for model_type, entry in found.items()]
    return lines


def _types(types: list[str]) -> str:
    return ", ".join(f"`{model_type}`" for model_type in types)


def readme_table(rows: list[FamilyRow], kit: dict[str, str], servers: dict[str, str], sweep: dict) -> str:
    """The generic plugin's count and refused kinds; then one row per first-party distribution: its model
    types, their cache kinds, the tests verifying them."""
    refused = "; ".join(f"{group} ({len(types)})" for group, types in refused_groups(sweep))
    lines = [
        README_START,
        f"{sweep_headline(sweep)}. Refused: {refused}. The types, and what is broken, per model type: "
        "[docs/families.md](docs/families.md).",
        "",
        "| distribution | model types (* kit only) | cache kinds (default configs) | conformance kit | real `petals serve` |",
        "|---|---|---|---|---|",
    ]
    for plugin, distribution in sorted(distributions("petals_*").items(), key=lambda item: item[1]):
        served = [row for row in rows if row.plugin == plugin]
        types = ", ".join(
            f"`{row.model_type}`" + ("" if naming(servers, row.model_type) else "*") for row in served
        )
        kinds = _unique(kind.split(":")[0] for row in served for kind in row.cache_kinds)
        kit_tests = _unique(path for row in served for path in naming(kit, row.model_type))
        server_tests = _unique(path for row in served for path in naming(servers, row.model_type))
        lines.append(
            f"| `{distribution}` | {types} | {', '.join(kinds) or '-'} | {_files(kit_tests)} | {_files(server_tests)} |"
        )
    lines.append(README_END)
    return "\n".join(lines)


def _files(paths: list[str]) -> str:
    return ", ".join(f"[{Path(path).stem}]({path})" for path in paths) or "-"


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def with_readme_table(readme: str, table: str) -> str:
    start, end = readme.index(README_START), readme.index(README_END) + len(README_END)
    return readme[:start] + table + readme[end:]


def main(argv: list[str]) -> int:
    rows = family_rows(get_plugin_manager())
    kit, servers = test_files(KIT, USES_KIT, helpers=True), test_files(SERVERS, STARTS_PROCESSES)
    sweep = json.loads(SWEEP.read_text()) if SWEEP.exists() else {}
    written = {
        PAGE: page(rows, kit, servers, sweep),
        README: with_readme_table(README.read_text(), readme_table(rows, kit, servers, sweep)),
    }
    if "--check" in argv:
        stale = [path for path, text in written.items() if path.read_text() != text]
        written_with = re.search(r"Model types from transformers (\S+)\.", PAGE.read_text())
        if written_with and written_with.group(1) != transformers.__version__:  # the page lists its types
            print(
                f"{PAGE.relative_to(ROOT)} lists transformers {written_with.group(1)}'s model types, this "
                f"environment has {transformers.__version__}: install the newest (make install) or run "
                "python docs/families.py",
                file=sys.stderr,
            )
        if sweep.get("transformers") not in (None, transformers.__version__):
            print(
                f"{SWEEP.relative_to(ROOT)} was swept with transformers {sweep['transformers']}, this environment "
                f"has {transformers.__version__}: run python docs/families_sweep.py --redo, then python "
                "docs/families.py",
                file=sys.stderr,
            )
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python docs/families.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in written.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
