"""Every hook is documented (plugins/README.md, with its exact arguments) and exercised by a test."""

import inspect
import re
from pathlib import Path

import pytest

from petals import hookspecs

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "plugins" / "README.md").read_text()
TEST_SOURCES = "\n".join(
    path.read_text() for path in [*ROOT.glob("tests/test_*.py"), *ROOT.glob("plugins/*/tests/test_*.py")]
)


@pytest.mark.parametrize("name", hookspecs.hook_names())
def test_hook_has_docstring_and_guide_section(name):
    spec = getattr(hookspecs, name)
    assert inspect.getdoc(spec), f"hook {name} has no docstring"
    arguments = ", ".join(inspect.signature(spec).parameters)
    assert f"### `{name}({arguments})`" in GUIDE, f"plugins/README.md has no section for {name}({arguments})"


@pytest.mark.parametrize("name", hookspecs.hook_names())
def test_hook_is_exercised_by_a_test(name):
    pattern = rf"(def {name}\(|hook\.{name}\()"  # an in-test implementation or a direct hook call
    uses = [line for line in TEST_SOURCES.splitlines() if re.search(pattern, line)]
    assert uses, f"no test implements or calls hook {name}"


def test_hook_names_lists_every_spec():
    assert {"register_model_families", "block_class", "kv_cache_layout", "dht_prefix"} <= set(
        hookspecs.hook_names()
    )
