"""``petals simulate``: a discrete-event simulation of a swarm that drives the product's own placement,
rebalancing and routing policies (``petals.policies``) over a scenario, without any networking.

``simulate(scenario, ["ours", "petals22"])`` returns, per policy, the metrics ``petals simulate --json``
writes (``coverage``, ``throughput``, ``throughput_bound``, ``latency_p50``, ``latency_p95``,
``moves_per_server_hour``, ``routing_ms_p95``, and the series over time).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from petals.policies import PLACEMENTS, ROUTINGS
from petals.simulate.scenario import GpuKind, Region, Scenario, load_scenario
from petals.simulate.swarm import Metrics, SimulatedSwarm, throughput_bound

POLICIES = ("ours", "petals22")

__all__ = [
    "POLICIES",
    "GpuKind",
    "Region",
    "Scenario",
    "load_scenario",
    "run_policy",
    "simulate",
    "throughput_bound",
]


def run_policy(scenario: Scenario, policy: str) -> dict:
    """Simulate ``scenario`` with one policy set; the metrics as a JSON-ready dict."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    options = scenario.policy_options.get(policy, {})
    placement = PLACEMENTS[policy](**options.get("placement", {}))
    routing = ROUTINGS[policy](**options.get("routing", {}))
    began = time.perf_counter()
    metrics = SimulatedSwarm(scenario, placement, routing).run()
    return summarize(metrics, time.perf_counter() - began)


def summarize(m: Metrics, wall_seconds: float) -> dict:
    seconds = max(m.seconds, 1e-9)
    latencies = np.array(m.latencies) if m.latencies else np.array([np.nan])
    routing_ms = np.array(m.routing_seconds) * 1000 if m.routing_seconds else np.array([np.nan])
    throughput, bound = m.throughput_integral / seconds, m.bound_integral / seconds
    return {
        "coverage": m.covered_seconds / seconds,
        "throughput": throughput,
        "throughput_bound": bound,
        "throughput_vs_bound": throughput / bound if bound > 0 else 0.0,
        "latency_p50": float(np.percentile(latencies, 50)),
        "latency_p95": float(np.percentile(latencies, 95)),
        "moves_per_server_hour": m.moves / max(m.server_seconds / 3600, 1e-9),
        "returns_within_check_period": m.returns_within_check_period,
        "routing_ms_p95": float(np.percentile(routing_ms, 95)),
        "routing_cpu_ms_p95": float(np.percentile(np.array(m.routing_cpu_seconds or [np.nan]) * 1000, 95)),
        "sessions": len(m.latencies),
        "failovers": m.failovers,
        "wall_seconds": wall_seconds,
        "series": m.series,
    }


def simulate(scenario: Scenario, policies: Sequence[str] = POLICIES) -> dict:
    """Every policy on the same trace, and how ours compares with Petals 2.2 when both ran."""
    return with_comparison(scenario, {policy: run_policy(scenario, policy) for policy in policies})


def with_comparison(scenario: Scenario, results: dict[str, dict]) -> dict:
    report = {"scenario": _scenario_dict(scenario), "policies": results}
    if "ours" in results and "petals22" in results:
        ours, base = results["ours"], results["petals22"]
        report["comparison"] = {
            "throughput_ratio": ours["throughput"] / max(base["throughput"], 1e-9),
            "latency_p50_ratio": ours["latency_p50"] / max(base["latency_p50"], 1e-9),
            "latency_p95_ratio": ours["latency_p95"] / max(base["latency_p95"], 1e-9),
            "moves_ratio": ours["moves_per_server_hour"] / max(base["moves_per_server_hour"], 1e-9),
        }
    return report


SUMMARY_KEYS = (
    "coverage",
    "throughput",
    "throughput_bound",
    "latency_p50",
    "latency_p95",
    "moves_per_server_hour",
    "routing_ms_p95",
    "wall_seconds",
)


def summary_lines(report: dict) -> list[str]:
    lines = [f"{'policy':10}" + "".join(f"{key:>24}" for key in SUMMARY_KEYS)]
    for policy, result in report["policies"].items():
        lines.append(f"{policy:10}" + "".join(f"{result[key]:>24.4g}" for key in SUMMARY_KEYS))
    for key, value in report.get("comparison", {}).items():
        lines.append(f"ours/petals22 {key}: {value:.3f}")
    return lines


def _scenario_dict(scenario: Scenario) -> dict:
    data = dataclasses.asdict(scenario)
    data["gpus"] = [dataclasses.asdict(gpu) for gpu in scenario.gpus]
    data["regions"] = [dataclasses.asdict(region) for region in scenario.regions]
    return data
