"""``petals simulate``: a discrete-event simulation of a swarm that drives the product's own placement,
rebalancing and routing policies (``petals.policies``) over a scenario, without any networking.

``simulate(scenario, ["ours", "petals22"])`` returns, per policy, the metrics ``petals simulate --json``
writes (``coverage``, ``throughput``, ``throughput_bound``, ``latency_p50``, ``latency_p95``,
``moves_per_server_hour``, ``routing_ms_p95``, and the series over time).

A scenario naming a ``model`` has its GPU kinds' capacities planned for that model from their memory
(``with_model_capacities``: the plan ``petals serve`` and ``petals plan`` use) before it runs.

``settle(scenario)`` runs a scenario's listed servers (``server_list``) without clients and says where
they ended up, the route a client of ``client_region`` takes and its per-token latency: what a real
swarm of the same servers should show (``tests/test_simulate_reality.py`` checks that it does).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from petals.policies import PLACEMENTS, ROUTINGS
from petals.simulate.capacity import with_model_capacities
from petals.simulate.scenario import GpuKind, Region, Scenario, ServerSpec, load_scenario, scenario_path
from petals.simulate.swarm import Metrics, SimulatedSwarm, throughput_bound

POLICIES = ("ours", "petals22")

__all__ = [
    "POLICIES",
    "GpuKind",
    "Region",
    "Scenario",
    "ServerSpec",
    "Settled",
    "load_scenario",
    "run_policy",
    "scenario_path",
    "settle",
    "simulate",
    "throughput_bound",
    "with_model_capacities",
]


def run_policy(scenario: Scenario, policy: str) -> dict:
    """Simulate ``scenario`` with one policy set; the metrics as a JSON-ready dict."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    scenario = with_model_capacities(scenario)
    options = scenario.policy_options.get(policy, {})
    placement = PLACEMENTS[policy](**options.get("placement", {}))
    routing = ROUTINGS[policy](**options.get("routing", {}))
    began = time.perf_counter()
    metrics = SimulatedSwarm(scenario, placement, routing).run()
    return summarize(metrics, time.perf_counter() - began)


@dataclass(frozen=True)
class Settled:
    """A listed swarm after ``hours``: servers are numbered in join order."""

    blocks: list[range]  # each server's blocks
    moves: int  # rebalancing moves over the whole run
    route: list[tuple[int, int, int]]  # (server, start, end): the route most routing draws gave
    route_share: float  # the fraction of draws that gave ``route`` (routing may be randomized)
    seconds_per_token: float  # on ``route``, for a client of ``client_region``


def settle(scenario: Scenario, policy: str = "ours", draws: int = 32) -> Settled:
    """Join ``scenario``'s listed servers one by one, let them check their balance for ``hours`` (no
    clients, no churn), then route ``draws`` new sessions from ``client_region``."""
    if not scenario.server_list or scenario.client_region is None or scenario.churn != 0:
        raise ValueError("settle needs a scenario with a server_list, a client_region and churn 0")
    scenario = with_model_capacities(scenario)
    options = scenario.policy_options.get(policy, {})
    swarm = SimulatedSwarm(
        scenario.replace(clients=0, warmup_hours=0),
        PLACEMENTS[policy](**options.get("placement", {})),
        ROUTINGS[policy](**options.get("routing", {})),
    )
    metrics = swarm.run()
    region = [region.name for region in scenario.regions].index(scenario.client_region)
    rng = np.random.default_rng([scenario.seed, 11])
    routes = [swarm.route_from(region, rng) for _ in range(draws)]
    counts = Counter(tuple(route) for route, _ in routes)
    route, count = counts.most_common(1)[0]
    return Settled(
        blocks=[range(int(swarm.starts[slot]), int(swarm.ends[slot])) for slot in range(swarm.count)],
        moves=metrics.moves,
        route=list(route),
        route_share=count / draws,
        seconds_per_token=next(seconds for taken, seconds in routes if tuple(taken) == route),
    )


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
