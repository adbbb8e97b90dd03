"""The PNG of ``petals simulate --plot``: coverage, throughput (with its bound) and latency over time."""

from __future__ import annotations

from pathlib import Path

COLORS = {"ours": "tab:blue", "petals22": "tab:orange"}


def plot_report(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (coverage, throughput, latency) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for policy, result in report["policies"].items():
        series, color = result["series"], COLORS.get(policy)
        coverage.step(series["hours"], series["coverage"], where="post", color=color, label=policy)
        throughput.plot(series["hours"], series["throughput"], color=color, label=f"{policy} bottleneck")
        latencies = [float("nan") if value is None else value for value in series["latency_p50"]]
        latency.plot(series["hours"], latencies, color=color, label=f"{policy} p50")
    first = next(iter(report["policies"].values()), None)
    if first is not None:
        series = first["series"]
        throughput.plot(series["hours"], series["bound"], color="gray", linestyle="--", label="bound (LP)")
    scenario = report["scenario"]
    figure.suptitle(
        f"{scenario['servers']} servers, {scenario['blocks']} blocks, churn {scenario['churn']}/server-hour, "
        f"{scenario['clients']} clients, seed {scenario['seed']}"
    )
    coverage.set_ylabel("every block served")
    coverage.set_ylim(-0.05, 1.05)
    throughput.set_ylabel("tokens/s (bottleneck)")
    latency.set_ylabel("s per token (recent p50)")
    latency.set_xlabel("simulated hours")
    for axis in (coverage, throughput, latency):
        axis.legend(loc="lower right", fontsize="small")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
