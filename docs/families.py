"""Write docs/families.md: the model types the first-party plugins serve (plugin, cache kinds, the tests
that check each), then every other causal-LM model type transformers knows and why it is not served.

    python docs/families.py          # rewrite docs/families.md
    python docs/families.py --check  # exit 1 if docs/families.md is not what this writes

The rows come from ``petals.families_report`` (what ``petals plugins --families`` prints) over the
installed plugins; the tests of a model type are the test files naming its transformers config class or
its quoted model type: the conformance kit's (a plugin's tests, ``tests/test_conformance.py`` over
``tests/conftest.py``'s tiny configs) and those running real ``petals serve`` processes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from petals.families_report import FamilyRow, family_rows

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "families.md"
KIT = ["petals_*/tests/*.py", "plugins/*/tests/test_*.py", "tests/conftest.py"]
SERVERS = [
    "tests/test_swarm*.py", "tests/test_server_swarm.py", "tests/test_e2e_*.py", "tests/test_gguf.py",
    "tests/test_gemma3_gguf.py", "tests/test_client_failover.py", "plugins/*/tests/*swarm*.py",
]  # fmt: skip


def test_files(patterns: list[str]) -> dict[str, str]:
    files = sorted({path for pattern in patterns for path in ROOT.glob(pattern)})
    return {str(path.relative_to(ROOT)): path.read_text() for path in files}


def naming(files: dict[str, str], model_type: str) -> list[str]:
    config_class = CONFIG_MAPPING_NAMES.get(model_type)
    names = [re.escape(f'"{model_type}"')] + ([rf"\b{config_class}\b"] if config_class else [])
    pattern = re.compile("|".join(names))
    found = [name for name, text in files.items() if pattern.search(text)]
    return ["tests/test_conformance.py" if name == "tests/conftest.py" else name for name in found]


def cell(paths: list[str]) -> str:
    return ", ".join(f"`{path}`" for path in paths) or "-"


def page(rows: list[FamilyRow]) -> str:
    kit, servers = test_files(KIT), test_files(SERVERS)
    served = [row for row in rows if row.plugin is not None]
    others = [row for row in rows if row.plugin is None]
    lines = [
        "# Model families",
        "",
        "Written by `python docs/families.py` (checked by `tests/test_families_report.py`); "
        "`petals plugins --families` prints the same rows for the plugins installed where it runs. "
        "Cache kinds are those of the model type's default config (transformers' defaults), through "
        "the serving plugin's `cache_spec`.",
        "",
        f"## Served by the first-party plugins ({len(served)} model types)",
        "",
        "| model type | plugin | cache kinds | conformance kit | through real `petals serve` |",
        "|---|---|---|---|---|",
    ]
    for row in served:
        kinds = ", ".join(row.cache_kinds) or row.note
        lines.append(
            f"| `{row.model_type}` | {row.plugin} | {kinds} | {cell(naming(kit, row.model_type))} "
            f"| {cell(naming(servers, row.model_type))} |"
        )
    lines += [
        "",
        f"## Not served ({len(others)} model types of transformers' causal-LM mapping)",
        "",
        "| model type | cache kinds | why |",
        "|---|---|---|",
    ]
    lines += [f"| `{row.model_type}` | {', '.join(row.cache_kinds) or '-'} | {row.note} |" for row in others]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = page(family_rows())
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python docs/families.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
