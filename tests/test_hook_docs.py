"""Every hook is documented (plugins/README.md, with its exact arguments) and called by a test."""

import inspect

import pytest

from conftest import CALLED_HOOKS, LAST_TEST, ROOT, missing_from_session
from petals import hookspecs

GUIDE = (ROOT / "plugins" / "README.md").read_text()


@pytest.mark.parametrize("name", hookspecs.hook_names())
def test_hook_has_docstring_and_guide_section(name):
    spec = getattr(hookspecs, name)
    assert inspect.getdoc(spec), f"hook {name} has no docstring"
    arguments = ", ".join(inspect.signature(spec).parameters)
    assert f"### `{name}({arguments})`" in GUIDE, f"plugins/README.md has no section for {name}({arguments})"


def test_hook_names_lists_every_spec():
    assert {
        "register_model_families",
        "dht_prefix",
        "cache_spec",
        "quantize_module",
        "tensor_parallel_config",
    } == set(hookspecs.hook_names())


def test_every_hook_is_called_by_some_test(request):
    """Runs after every other test (conftest orders it last) and reads the calls they made in this process."""
    assert request.node.name == LAST_TEST
    if hasattr(request.config, "workerinput"):  # pytest-xdist: the other tests ran in other processes too
        pytest.skip(
            "hook calls are recorded per process: run the whole suite without -n (make test) to check"
        )
    missing = missing_from_session(request.session)
    if missing:
        pytest.skip(f"needs the whole suite; this session leaves out {len(missing)}, e.g. {missing[0]}")
    never_called = sorted(set(hookspecs.hook_names()) - CALLED_HOOKS)
    assert not never_called, f"no test calls hooks {never_called}: test them in-process"
