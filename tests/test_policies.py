"""The pure placement and routing policies (petals.policies): the same objects the live server, the
live client and ``petals simulate`` call."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
from hivemind.p2p import PeerID

from conftest import tiny_config
from petals.client.routing import RemoteSequenceManager
from petals.data_structures import RemoteSpanInfo, ServerInfo, ServerState
from petals.plugins import get_plugin_manager
from petals.policies import (
    OursPlacement,
    OursRouting,
    Petals22Placement,
    Petals22Routing,
    RouteCandidates,
    SwarmView,
)
from petals.policies.placement import MoveHistory, weakest_window
from petals.policies.routing import HOP_OVERHEAD


def dijkstra_cost(c: RouteCandidates, start: int, end: int) -> float:
    """Petals' graph searched node by node, as Petals does: the reference for the vectorized program."""
    best, queue, counter = {"start": 0.0}, [(0.0, 0, "start")], itertools.count(1)
    while queue:
        cost, _, node = heapq.heappop(queue)
        if node == "end":
            return cost
        if cost > best.get(node, np.inf):
            continue
        for neighbour, weight in edges(c, node, start, end):
            if cost + weight < best.get(neighbour, np.inf):
                best[neighbour] = cost + weight
                heapq.heappush(queue, (cost + weight, next(counter), neighbour))
    return np.inf


def edges(c: RouteCandidates, node, start: int, end: int):
    covering = lambda block: [i for i in range(len(c)) if c.starts[i] <= block < c.ends[i]]  # noqa: E731
    if node == "start":
        yield from (((i, start, False), c.client_rtt[i] / 2 + HOP_OVERHEAD) for i in covering(start))
        return
    peer, boundary, used = node
    if boundary == end:
        if used:
            yield "end", c.client_rtt[peer] / 2
        return
    if boundary < c.ends[peer]:
        yield (peer, boundary + 1, True), c.step_seconds[peer]
    if used:
        for other in covering(boundary):
            if other != peer:
                hop = c.hop_seconds[c.sites[peer], c.sites[other]] + HOP_OVERHEAD
                yield (other, boundary, False), hop


def route_cost(c: RouteCandidates, route, start: int, end: int) -> float:
    assert route[0][1] == start and route[-1][2] == end
    assert all(a[2] == b[1] for a, b in itertools.pairwise(route))
    cost = c.client_rtt[route[0][0]] / 2 + c.client_rtt[route[-1][0]] / 2 + HOP_OVERHEAD * len(route)
    for peer, first, stop in route:
        assert c.starts[peer] <= first < stop <= c.ends[peer]
        cost += (stop - first) * c.step_seconds[peer]
    for (a, _, _), (b, _, _) in itertools.pairwise(route):
        cost += c.hop_seconds[c.sites[a], c.sites[b]]
    return cost


def random_candidates(rng: np.random.Generator, servers: int, blocks: int, sites: int) -> RouteCandidates:
    starts = rng.integers(0, blocks, servers)
    ends = np.minimum(starts + rng.integers(1, blocks, servers), blocks)
    hops = rng.uniform(0.001, 0.1, (sites, sites))
    return RouteCandidates(
        starts=starts,
        ends=ends,
        step_seconds=rng.uniform(0.001, 0.03, servers),
        client_rtt=rng.uniform(0.005, 0.2, servers),
        sites=rng.integers(0, sites, servers),
        hop_seconds=(hops + hops.T) / 2,
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_vectorized_route_costs_what_dijkstra_finds(seed):
    rng = np.random.default_rng(seed)
    c = random_candidates(rng, servers=int(rng.integers(1, 9)), blocks=8, sites=int(rng.integers(1, 4)))
    start, end = 0, 8
    expected = dijkstra_cost(c, start, end)
    if not np.isfinite(expected):
        with pytest.raises(ValueError, match="no chain of servers covers"):
            Petals22Routing().route(c, start, end, rng)
        return
    route = Petals22Routing().route(c, start, end, rng)
    assert route_cost(c, route, start, end) == pytest.approx(expected)


def test_a_route_takes_a_fast_chain_over_a_slow_server_and_can_start_midway():
    c = RouteCandidates(
        starts=np.array([0, 2, 0]),
        ends=np.array([2, 4, 4]),
        step_seconds=np.array([0.01, 0.01, 0.05]),
        client_rtt=np.array([0.02, 0.02, 0.02]),
        sites=np.array([0, 1, 2]),
        hop_seconds=np.array([[0, 0.005, 0.05], [0.005, 0, 0.05], [0.05, 0.05, 0]]),
    )
    rng = np.random.default_rng(0)
    assert Petals22Routing().route(c, 0, 4, rng) == [(0, 0, 2), (1, 2, 4)]
    assert Petals22Routing().route(c, 1, 3, rng) == [(0, 1, 2), (1, 2, 3)]
    far = RouteCandidates(c.starts, c.ends, c.step_seconds, c.client_rtt, c.sites, c.hop_seconds * 40)
    assert Petals22Routing().route(far, 0, 4, rng) == [(2, 0, 4)]  # one slow server beats a far hop


def test_ours_spreads_clients_over_equal_servers_and_avoids_loaded_ones():
    servers = 6
    c = RouteCandidates(
        starts=np.zeros(servers, int),
        ends=np.full(servers, 4),
        step_seconds=np.full(servers, 0.01),
        client_rtt=np.full(servers, 0.02),
        sites=np.zeros(servers, int),
        hop_seconds=np.zeros((1, 1)),
    )
    rng = np.random.default_rng(0)
    assert {Petals22Routing().route(c, 0, 4, rng)[0][0] for _ in range(30)} == {0}  # everyone on one server
    assert len({OursRouting().route(c, 0, 4, rng)[0][0] for _ in range(30)}) >= 4
    loaded = RouteCandidates(**{**c.__dict__, "load": np.array([5, 5, 5, 5, 5, 0])})
    assert {OursRouting().route(loaded, 0, 4, rng)[0][0] for _ in range(30)} == {5}


NO_HISTORY = MoveHistory()


def view(spans, total=4) -> SwarmView:
    return SwarmView.from_spans(total, spans)


def test_the_weakest_window_comes_first_with_ties_to_the_lowest_index():
    assert weakest_window(np.array([0.0, 0.0, 0.0, 0.0]), 2) == 0
    assert weakest_window(np.array([2.0, 2.0, 1.0, 1.0]), 2) == 2
    assert weakest_window(np.array([1.0, 0.0, 0.0, 1.0]), 1) == 1
    assert weakest_window(np.array([1.0, 0.0, 3.0, 0.0, 2.0]), 3) == 1  # (0, 1, 3) < (0, 2, 3)


def test_ours_counts_what_a_server_gives_each_block_where_petals_overrates_long_spans():
    # a: 4 blocks, forward_rps 8 (2 per block, Petals announces 8 / 2.5 = 3.2); b: 1 block, 2.5 per block
    swarm = view([(0, 4, 3.2, 8.0), (3, 4, 2.5, 2.5)], total=5)
    assert list(OursPlacement().levels(swarm)) == pytest.approx([2, 2, 2, 4.5, 0])
    assert list(Petals22Placement().levels(swarm)) == pytest.approx([3.2, 3.2, 3.2, 5.7, 0])
    assert OursPlacement().choose_blocks(swarm, 1) == range(4, 5)
    without_forward = view([(0, 2, 1.0, None)])
    assert list(OursPlacement().levels(without_forward)) == [1.0, 1.0, 0.0, 0.0]


def decide(placement, swarm, index=0, now=0.0, history=NO_HISTORY):
    return placement.choose_new_blocks(swarm, index, now=now, rng=np.random.default_rng(0), history=history)


def test_ours_moves_only_when_the_gain_beats_the_margin():
    crowded = view([(0, 2, 1.0, None), (0, 2, 1.0, None), (2, 4, 0.1, None)])
    decision = decide(OursPlacement(), crowded)
    assert decision.blocks == range(2, 4) and "moving would help" in decision.reason
    nearly_even = view([(0, 2, 1.0, None), (0, 2, 1.0, None), (2, 4, 0.95, None)])
    assert decide(OursPlacement(margin=0.15), nearly_even).blocks is None
    alone = view([(0, 2, 1.0, None), (2, 4, 0.1, None)])
    assert "the only server" in decide(OursPlacement(), alone).reason


def test_ours_never_returns_within_a_check_period_to_a_range_it_left():
    crowded = view([(0, 2, 1.0, None), (0, 2, 1.0, None), (2, 4, 0.1, None)])
    placement = OursPlacement(mean_check_period=60)
    history = MoveHistory(left=range(2, 4), left_at=100.0)
    decision = decide(placement, crowded, now=130.0, history=history)
    assert decision.blocks is None and "left blocks 2:4 30 s ago" in decision.reason
    assert decide(placement, crowded, now=161.0, history=history).blocks == range(2, 4)


def test_moving_back_right_after_a_move_never_pays_for_ours():
    rng = np.random.default_rng(1)
    for _ in range(200):
        spans = [(int(s), int(s) + 3, 1.0, float(rng.uniform(1, 10))) for s in rng.integers(0, 6, 12)]
        swarm = view(spans, total=9)
        decision = decide(OursPlacement(), swarm)
        if decision.blocks is None:
            continue
        moved = [(decision.blocks.start, decision.blocks.stop, *spans[0][2:]), *spans[1:]]
        back = decide(OursPlacement(), view(moved, total=9))
        assert back.blocks != range(spans[0][0], spans[0][1])


def test_petals22_moves_by_balance_quality_and_settles_small_swarms_exactly():
    crowded = view([(0, 2, 1.0, None), (0, 2, 1.0, None), (2, 4, 0.1, None)])
    assert decide(Petals22Placement(0.75), crowded).blocks == range(2, 4)
    assert "balance quality" in decide(Petals22Placement(0.75), crowded).reason
    assert decide(Petals22Placement(0.05), crowded).blocks is None  # 0.1 / 1.1 ≈ 9% is not below 5%
    balanced = view([(0, 2, 1.0, None), (0, 2, 1.0, None), (2, 4, 1.0, None), (2, 4, 1.0, None)])
    assert "still the best range" in decide(Petals22Placement(2.0), balanced).reason  # bug #389: no reload


def test_balance_checks_come_at_random_with_the_documented_mean():
    rng = np.random.default_rng(0)
    for placement in (Petals22Placement(), OursPlacement()):
        delays = [placement.check_delay(rng) for _ in range(20000)]
        assert min(delays) >= 0 and max(delays) <= 120
        assert np.mean(delays) == pytest.approx(60, rel=0.02)


def sequence_manager(routing: str) -> RemoteSequenceManager:
    tiny = tiny_config("llama")
    config = get_plugin_manager().family(tiny.model_type).config_class.from_dict(tiny.to_dict())
    config.dht_prefix, config.routing = "policies", routing
    return RemoteSequenceManager(config, network=None, num_blocks=4)


def test_the_live_client_routes_with_the_same_policy_objects():
    peers = [PeerID(name.encode()) for name in ("fast-a", "fast-b", "slow")]
    announced = {peers[1].to_base58(): 0.004}
    infos = [
        ServerInfo(ServerState.ONLINE, 1.0, inference_rps=100.0, next_pings=announced),
        ServerInfo(ServerState.ONLINE, 1.0, inference_rps=100.0),
        ServerInfo(ServerState.ONLINE, 1.0, inference_rps=20.0),
    ]
    spans = [
        RemoteSpanInfo(peers[0], 0, 2, infos[0]),
        RemoteSpanInfo(peers[1], 2, 4, infos[1]),
        RemoteSpanInfo(peers[2], 0, 4, infos[2]),
    ]
    for routing in ("ours", "petals22"):
        manager = sequence_manager(routing)
        assert manager.routing.name == routing
        manager.pings = dict.fromkeys(peers, 0.01)
        candidates = manager.route_candidates(spans)
        assert candidates.hop_seconds[0, 1] == pytest.approx(0.002)  # fast-a's announced ping, one way
        assert candidates.hop_seconds[1, 0] == pytest.approx(0.01)  # none announced: via the client
        route = manager._min_latency(spans, 0, 4)
        assert [(span.peer_id, span.start, span.end) for span in route] == [
            (peers[0], 0, 2),
            (peers[1], 2, 4),
        ]
