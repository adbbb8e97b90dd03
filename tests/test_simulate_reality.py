"""The simulator agrees with reality: ``scenarios/loopback.yml`` run by ``petals.simulate.settle`` and by
a real loopback swarm of the same five servers, each behind a ``DelayProxy`` with the scenario's delay,
joining one at a time in the same order and announcing the scenario's speeds.

Both sides must choose the same block ranges and the same route for the client, and the per-token
latency measured through the real swarm (median of 20 single-token steps) must be within 25% of the
simulated one. The scenario's network model (a connection between two servers crosses the proxy of
the one that joined first) is checked too, on the pings the client measured and those the servers
announce for the hops of the route. Not on every pair of servers: two servers may each have dialed the
other, and which connection a ping takes can change over time (with c at 50 ms, a announced 69-71 ms
to c: between 46 ms through a's proxy and 106 ms through c's).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_config
from petals import AutoDistributedModelForCausalLM, tracing
from petals.server.throughput import ThroughputInfo
from petals.simulate import Scenario, load_scenario, scenario_path, settle
from petals.testing.delay_proxy import DelayProxy, free_local_port
from petals.testing.inprocess import InProcessDht, InProcessServer
from petals.testing.swarm import LOOPBACK_CLIENT

SCENARIO = load_scenario(scenario_path("loopback"))
UPDATE_PERIOD = "2"  # seconds between announcements: next_pings are measured and announced that often
WARMUP_STEPS, STEPS = 3, 20
# of a scenario's round trip, what is not the proxies' delay: p2p daemons, proxy lateness (see the file)
TRANSPORT_RTT_MS = 6.0
PING_BELOW, PING_ABOVE = 0.005, 0.020  # how far a measured ping may be from the scenario's round trip


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    config = tiny_config("llama")
    config.num_hidden_layers = SCENARIO.blocks
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("reality") / "tiny-llama"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def one_way_delays_ms(scenario: Scenario) -> list[float]:
    """Each listed server's proxy delay: half the client's round trip to its region, less transport."""
    regions = [region.name for region in scenario.regions]
    client = regions.index(scenario.client_region)
    return [
        (scenario.rtt_ms[client][regions.index(spec.region)] - TRANSPORT_RTT_MS) / 2
        for spec in scenario.server_list
    ]


@contextlib.contextmanager
def real_swarm(path: Path, scenario: Scenario) -> Iterator[tuple[InProcessDht, list[InProcessServer]]]:
    """The scenario's servers, started one by one (each ONLINE before the next joins) behind proxies."""
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        servers = []
        for (gpu_index, _), delay_ms in zip(scenario.server_kinds, one_way_delays_ms(scenario), strict=True):
            gpu = scenario.gpus[gpu_index]
            port = free_local_port()
            proxy = stack.enter_context(DelayProxy(port, delay_ms))
            num_blocks = min(gpu.max_blocks, scenario.blocks)
            server = InProcessServer(
                path,
                dht.initial_peers,
                "--num_blocks",
                str(num_blocks),
                "--torch_dtype",
                "float32",
                "--update_period",
                UPDATE_PERIOD,
                "--host_maddrs",
                f"/ip4/127.0.0.1/tcp/{port}",
                "--announce_maddrs",
                f"/ip4/127.0.0.1/tcp/{proxy.port}",
                throughput=ThroughputInfo(
                    gpu.forward_rps / ((num_blocks + 1) / 2), float(gpu.forward_rps), float(gpu.inference_rps)
                ),
            )
            servers.append(stack.enter_context(server.start()))
        yield dht, servers


def next_pings_missing(manager) -> list[tuple[str, str]]:
    """(server, next server) pairs without an announced ping: after each span, every ONLINE server
    hosting the block after it should have one."""
    spans = list(manager.online_spans.values())
    return [
        (str(span.peer_id), str(nxt.peer_id))
        for span in spans
        for nxt in spans
        if span.end < len(manager) and nxt.start <= span.end < nxt.end
        if nxt.peer_id.to_base58() not in (span.server_info.next_pings or {})
    ]


def pings_against_scenario(
    manager, index_of: dict[str, int], route: list[tuple[int, int, int]]
) -> dict[tuple[int | None, int], tuple[float, float]]:
    """(from, to) -> (measured, the scenario's round trip) for the client's pings (from None) and the
    pings announced for the hops of ``route`` (see the module's docstring)."""
    rtt = np.array(SCENARIO.rtt_ms) / 1000
    region_of = [region for _, region in SCENARIO.server_kinds]
    client = [region.name for region in SCENARIO.regions].index(SCENARIO.client_region)
    hops = set(itertools.pairwise(server for server, _, _ in route))
    pings = {
        (None, index_of[str(peer)]): (measured, rtt[client, region_of[index_of[str(peer)]]])
        for peer, measured in manager.pings.items()
    }
    for peer, span in manager.online_spans.items():
        for name, measured in (span.server_info.next_pings or {}).items():
            pair = (index_of[str(peer)], index_of[name])
            if pair in hops:
                pings[pair] = (measured, rtt[region_of[pair[0]], region_of[pair[1]]])
    return pings


def agree(pings: dict[tuple[int | None, int], tuple[float, float]]) -> bool:
    return all(expected - PING_BELOW <= real <= expected + PING_ABOVE for real, expected in pings.values())


def wait_for_pings(
    manager, index_of: dict[str, int], route: list[tuple[int, int, int]], timeout: float = 30.0
) -> dict[tuple[int | None, int], tuple[float, float]]:
    """Until every server announces its next pings and those of ``route`` settle: servers smooth them
    (half the newest each announcement), so a first ping that also set up a connection (several round
    trips) fades within a few announcements; the client pings each server once, so a ping it took
    while this shared machine was busy is taken again. Returns the pings at the end, agreeing or not."""
    deadline = time.monotonic() + timeout
    while True:
        manager.network.run(manager.update(), timeout=30)
        missing = next_pings_missing(manager)
        ready = len(manager.online_spans) == SCENARIO.servers and not missing
        pings = pings_against_scenario(manager, index_of, route)
        if ready and agree(pings):
            return pings
        if time.monotonic() > deadline:
            assert ready, f"servers did not announce their next pings in {timeout} s: {missing}"
            return pings
        manager.pings.clear()
        time.sleep(0.5)


@pytest.mark.slow
def test_a_real_loopback_swarm_does_what_the_simulation_says(model_path):
    simulated = settle(SCENARIO)
    assert simulated.moves == 0  # a settled swarm: the live servers' balance checks must not move either
    assert simulated.route_share == 1.0  # routing's random spread cannot change this scenario's route

    with (
        real_swarm(model_path, SCENARIO) as (dht, servers),
        contextlib.closing(
            AutoDistributedModelForCausalLM.from_pretrained(
                model_path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
        ) as model,
    ):
        index_of = {server.peer_id: index for index, server in enumerate(servers)}
        manager = model.remote_blocks.manager
        pings = wait_for_pings(manager, index_of, simulated.route)
        spans = {index_of[str(peer)]: span for peer, span in manager.online_spans.items()}
        blocks = [range(spans[index].start, spans[index].end) for index in range(len(servers))]
        assert blocks == simulated.blocks
        shown = {pair: f"{real * 1e3:.1f} ms, not {rtt * 1e3:.0f}" for pair, (real, rtt) in pings.items()}
        assert agree(pings), f"the real round trips differ from the scenario's: {shown}"

        hidden = torch.randn(1, 1, model.config.hidden_size)
        with tracing.collect() as steps, model.remote_blocks.inference_session(max_length=64) as session:
            seconds = []
            for _ in range(WARMUP_STEPS + STEPS):
                began = time.perf_counter()
                session.step(hidden)
                seconds.append(time.perf_counter() - began)
            route = [(index_of[str(span.peer_id)], span.start, span.end) for span in session.route]

    assert route == simulated.route
    measured = statistics.median(seconds[WARMUP_STEPS:])
    ratio = measured / simulated.seconds_per_token
    assert 0.75 <= ratio <= 1.25, (
        f"per token: measured {measured * 1e3:.1f} ms, simulated {simulated.seconds_per_token * 1e3:.1f} ms; "
        f"where the measured time went: {tracing.format_means(steps[WARMUP_STEPS:])}; pings: {shown}"
    )


def test_the_scenarios_route_survives_the_worst_pings_the_test_lets_pass():
    """The route check cannot fail by chance: with the round trips the route uses at their highest and
    all others at their lowest (a route's cost is a sum of halves of round trips), it still wins."""
    route = settle(SCENARIO).route
    regions = [region for _, region in SCENARIO.server_kinds]
    client = [region.name for region in SCENARIO.regions].index(SCENARIO.client_region)
    servers = [regions[server] for server, _, _ in route]
    worst = np.array(SCENARIO.rtt_ms, dtype=float) - PING_BELOW * 1000
    np.fill_diagonal(worst, 0.0)
    for pair in [(client, servers[0]), (client, servers[-1]), *itertools.pairwise(servers)]:
        worst[pair] += (PING_BELOW + PING_ABOVE) * 1000
    assert settle(SCENARIO.replace(rtt_ms=tuple(map(tuple, worst)))).route == route
