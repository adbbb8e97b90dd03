"""Swarm scale: ``petals simulate``'s default scenario (1,000 servers, 80 blocks, 24 simulated hours,
churn 0.5 per server-hour, 200 clients), ours against Petals 2.2's policies on the same trace.

The headline ratio is ours' median per-token latency over Petals 2.2's; the checks are the goals of
the issue that asked for the simulator. ``--quick`` runs 60 servers for 1 hour. The plot lands next
to the JSON (``swarm_scale.png``), for the README.
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor

from benchmarks.harness import RESULTS_DIR, Check, Context, Result, main
from petals.simulate import POLICIES, Scenario, run_policy, with_comparison
from petals.simulate.plot import plot_report


def swarm_scale(ctx: Context) -> Result:
    scenario = ctx.pick(Scenario(), Scenario(servers=60, blocks=16, hours=1.0, clients=12))
    with ProcessPoolExecutor(len(POLICIES)) as pool:
        results = dict(zip(POLICIES, pool.map(run_policy, [scenario] * 2, POLICIES), strict=True))
    report = with_comparison(scenario, results)
    if not ctx.quick:
        plot_report(report, RESULTS_DIR / "swarm_scale.png")
    ours, base, ratios = results["ours"], results["petals22"], report["comparison"]
    for result in results.values():
        del result["series"]
    return Result(
        item="w",
        title=f"swarm scale: {scenario.servers} simulated servers, {scenario.hours:g} h, ours vs Petals 2.2's policies",
        ratio=ratios["latency_p50_ratio"],
        baseline="Petals 2.2's placement and routing on the same trace (median per-token latency)",
        checks=[
            Check("coverage (ours)", ours["coverage"], 0.999, ">=", unit=""),
            Check("throughput / bound (ours)", ours["throughput_vs_bound"], 0.9, ">="),
            Check("throughput ours / petals22", ratios["throughput_ratio"], 1.2, ">="),
            Check("latency p50 ours / petals22", ratios["latency_p50_ratio"], 0.85, "<="),
            Check("latency p95 ours / petals22", ratios["latency_p95_ratio"], 1.0, "<="),
            Check(
                "moves/server-hour ours - petals22",
                ours["moves_per_server_hour"] - base["moves_per_server_hour"],
                0,
                "<=",
                unit="",
            ),
            Check(
                "returns within a check period (ours)", ours["returns_within_check_period"], 0, "<=", unit=""
            ),
            Check("routing ms p95 (ours)", ours["routing_ms_p95"], 10, "<=", unit="ms"),
            Check("wall seconds per policy (ours)", ours["wall_seconds"], 300, "<=", unit="s"),
        ],
        measurements=report,
        settings={"servers": scenario.servers, "hours": scenario.hours, "seed": scenario.seed},
        notes=[
            f"{policy}: coverage {r['coverage']:.4f}, throughput {r['throughput']:.0f} of bound "
            f"{r['throughput_bound']:.0f} tokens/s, latency p50 {r['latency_p50']:.3f} s p95 {r['latency_p95']:.3f} s, "
            f"{r['moves_per_server_hour']:.3f} moves/server-hour, routing p95 {r['routing_ms_p95']:.1f} ms, "
            f"{r['wall_seconds']:.0f} s"
            for policy, r in results.items()
        ],
    )


BENCHMARKS = {"swarm_scale": swarm_scale}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
