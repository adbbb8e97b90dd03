"""Small functions: no function or method in ``core/petals`` is longer than 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import petals
from petals.patches import parse_source

MAX_FUNCTION_LINES = 60


def function_lengths(root: Path) -> dict[str, int]:
    """``path:line name`` → lines from ``def`` to the last line of the body (decorators not counted)."""
    lengths = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(parse_source(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                where = f"{path.relative_to(root)}:{node.lineno} {node.name}"
                lengths[where] = node.end_lineno - node.lineno + 1
    return lengths


def test_the_measure_counts_a_function_from_def_to_its_last_line(tmp_path):
    (tmp_path / "m.py").write_text("@decorated\ndef f():\n    x = 1\n\n    return x\n\n\ndef g(): pass\n")
    assert function_lengths(tmp_path) == {"m.py:2 f": 4, "m.py:8 g": 1}


def test_no_function_in_core_is_longer_than_60_lines():
    lengths = function_lengths(Path(petals.__file__).parent)
    assert len(lengths) > 100  # the whole package was read
    too_long = {where: length for where, length in lengths.items() if length > MAX_FUNCTION_LINES}
    assert too_long == {}
