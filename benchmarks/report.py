"""The suite's summary: a Markdown table and a chart of every result in a results folder.

python -m benchmarks.report [benchmarks/results]     # re-render without running anything
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR

UNITS = {"x": "{:.2f}x", "s": "{:.2f} s", "MiB": "{:.0f} MiB", "processes": "{:.0f}"}


def load(results_dir: Path) -> list[dict[str, Any]]:
    """The suite's records; other JSON there (the GPU check's ``gpu_<device>.json``) has no ``item``."""
    records = [json.loads(path.read_text()) for path in results_dir.glob("*.json")]
    suite = [record for record in records if "item" in record]
    return sorted(suite, key=lambda record: (record["item"], record["benchmark"]))


def formatted(value: float, unit: str) -> str:
    return UNITS.get(unit, "{:.3g} " + unit).format(value)


def describe(record: dict[str, Any]) -> str:
    lines = [f"{record['title']}: ratio {record['ratio']:.2f}x vs {record['baseline']}"]
    for check in record["checks"]:
        verdict = "met" if check["met"] else "NOT met"
        goal = f"{check['op']} {formatted(check['goal'], check['unit'])}"
        lines.append(
            f"  {check['name']}: {formatted(check['value'], check['unit'])} (goal {goal}: {verdict})"
        )
    lines.extend(f"  {note}" for note in record.get("notes", []))
    return "\n".join(lines)


def cell(text: str) -> str:
    """``text`` in a Markdown table cell: a pipe in it (``max |diff|``) would end the cell."""
    return text.replace("|", "\\|")


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        "| benchmark | measured | goal | met? |",
        "| --- | --- | --- | --- |",
    ]
    for record in records:
        if not record["checks"]:  # a measurement with no goal (the transport floor): its ratio
            rows.append(
                f"| ({record['item']}) {record['benchmark']}: vs {record['baseline']} | {record['ratio']:.2f}x | - | - |"
            )
        for check in record["checks"]:
            rows.append(
                f"| ({record['item']}) {record['benchmark']}: {cell(check['name'])} | {formatted(check['value'], check['unit'])} "
                f"| {check['op']} {formatted(check['goal'], check['unit'])} | {'yes' if check['met'] else 'no'} |"
            )
    if records:
        machine, first = records[0]["machine"], records[0]
        rows.append("")
        rows.append(
            f"Machine: {machine['cpu']}, {machine['logical_cores']} cores, {machine['memory_gib']} GiB; "
            f"torch {machine['torch']}, transformers {machine['transformers']}, hivemind {machine['hivemind']}; "
            f"commit {machine['git_commit']}; {first['date']}{' (--quick: not a measurement)' if first['quick'] else ''}."
        )
    return "\n".join(rows)


def chart(records: list[dict[str, Any]], path: Path) -> None:
    """One panel per goal: the measured value as a bar (green when met), the goal as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    checks = [(record, check) for record in records for check in record["checks"]]
    if not checks:
        return
    columns = min(4, len(checks))
    rows = math.ceil(len(checks) / columns)
    figure, axes = pyplot.subplots(
        rows, columns, figsize=(3.2 * columns, 3.0 * rows), squeeze=False, layout="constrained"
    )
    for axis, (record, check) in zip(axes.flat, checks, strict=False):
        axis.bar([0], [check["value"]], color="tab:green" if check["met"] else "tab:red", width=0.5)
        axis.axhline(
            check["goal"], color="black", linestyle="--", label=f"goal {check['op']} {check['goal']:g}"
        )
        axis.set_xticks([])
        axis.set_xlim(-0.75, 0.75)
        top = max(check["value"], check["goal"]) * 1.25
        axis.set_ylim(0, top or 1.0)  # a goal of 0 met by 0 still gets a scale
        axis.set_title(f"({record['item']}) {record['benchmark']}\n{check['name']}", fontsize=8)
        axis.set_ylabel(check["unit"])
        axis.text(
            0, check["value"], formatted(check["value"], check["unit"]), ha="center", va="bottom", fontsize=9
        )
        axis.legend(fontsize=7, loc="upper right")
    for axis in list(axes.flat)[len(checks) :]:
        axis.set_visible(False)
    figure.suptitle("petals-core vs goals (ratios: product / plain transformers)", fontsize=10)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def render(results_dir: Path) -> str:
    """Write ``summary.md`` and ``chart.png`` into ``results_dir``; return the table."""
    records = load(results_dir)
    text = table(records)
    if records:
        (results_dir / "summary.md").write_text(text + "\n")
        chart(records, results_dir / "chart.png")
    return text


if __name__ == "__main__":
    print(render(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS_DIR))
