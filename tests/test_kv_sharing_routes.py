"""Placement and routing around layers that reuse the keys and values of earlier ones: no span of blocks a
server runs in one pass, nor any hop of a chain, begins or ends between such a layer and its source."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import types

import numpy as np
import pytest
from hivemind.p2p import PeerID
from test_policies import random_candidates, route_cost

from conftest import tiny_config
from petals.client.routing import MissingBlocksError, RemoteSequenceManager, _max_throughput
from petals.data_structures import RemoteSpanInfo, ServerInfo, ServerState
from petals.plugins import get_plugin_manager
from petals.policies import OursPlacement, Petals22Routing, RouteCandidates, SwarmView
from petals.policies.placement import shared_groups, span_lengths, weakest_window
from petals.policies.routing import HOP_OVERHEAD
from petals.server.planning import check_block_indices, choose_num_blocks, longest_placeable
from petals.server.settings import SettingError

# 6 layers, layers 4 and 5 reuse the keys and values of layers 2 and 3: blocks 2:6 go together
CLOSED = frozenset({3, 4, 5})


def switches(route) -> list[int]:
    """The boundaries where a route changes servers."""
    return [first for _, first, _ in route[1:]]


def test_shared_groups_are_the_runs_of_blocks_around_closed_boundaries():
    assert shared_groups(CLOSED) == [range(2, 6)]
    assert shared_groups(frozenset({3, 6, 7})) == [range(2, 4), range(5, 8)]
    assert shared_groups(frozenset()) == []
    assert span_lengths(6, CLOSED) == [1, 2, 4, 5, 6]


# ---- min_latency_route -----------------------------------------------------------------------------


def test_a_route_stays_on_one_server_across_blocks_that_share_keys_and_values():
    fast_head, fast_tail, slow_group = 0, 1, 2
    c = RouteCandidates(
        starts=np.array([0, 4, 2]),
        ends=np.array([4, 6, 6]),
        step_seconds=np.array([0.01, 0.01, 0.05]),
        client_rtt=np.full(3, 0.02),
        sites=np.arange(3),
        hop_seconds=np.full((3, 3), 0.001),
    )
    rng = np.random.default_rng(0)
    assert Petals22Routing().route(c, 0, 6, rng) == [(fast_head, 0, 4), (fast_tail, 4, 6)]  # cheapest
    constrained = dataclasses.replace(c, closed=CLOSED)
    assert Petals22Routing().route(constrained, 0, 6, rng) == [(fast_head, 0, 2), (slow_group, 2, 6)]


def reference_cost(c: RouteCandidates, start: int, end: int) -> float:
    """The cheapest chain that switches servers only at open boundaries, found by plain recursion over
    (boundary, previous server): the reference for the vectorized program with ``closed``."""

    @functools.cache
    def best(block: int, previous: int | None) -> float:
        costs = [np.inf]
        for peer in range(len(c)):
            if peer == previous or not c.starts[peer] <= block < c.ends[peer]:
                continue
            enter = (
                c.client_rtt[peer] / 2
                if previous is None
                else c.hop_seconds[c.sites[previous], c.sites[peer]]
            )
            for stop in range(block + 1, min(c.ends[peer], end) + 1):
                if stop in c.closed:
                    continue
                rest = c.client_rtt[peer] / 2 if stop == end else best(stop, peer)
                costs.append(enter + HOP_OVERHEAD + (stop - block) * c.step_seconds[peer] + rest)
        return min(costs)

    return best(start, None)


@pytest.mark.parametrize("seed", range(30))
def test_the_route_is_the_cheapest_chain_that_never_switches_at_a_closed_boundary(seed):
    rng = np.random.default_rng(seed)
    c = random_candidates(rng, servers=int(rng.integers(2, 9)), blocks=8, sites=int(rng.integers(1, 4)))
    low = int(rng.integers(1, 7))
    c = dataclasses.replace(c, closed=frozenset(range(low, int(rng.integers(low, 8)) + 1)))
    expected = reference_cost(c, 0, 8)
    if not np.isfinite(expected):
        with pytest.raises(ValueError, match="no chain of servers covers"):
            Petals22Routing().route(c, 0, 8, rng)
        return
    route = Petals22Routing().route(c, 0, 8, rng)
    assert not set(switches(route)) & c.closed
    assert route_cost(c, route, 0, 8) == pytest.approx(expected)


def test_a_route_may_not_begin_or_end_between_blocks_that_share_keys_and_values():
    c = RouteCandidates(
        starts=np.array([0]),
        ends=np.array([6]),
        step_seconds=np.array([0.01]),
        client_rtt=np.array([0.02]),
        sites=np.array([0]),
        hop_seconds=np.zeros((1, 1)),
        closed=CLOSED,
    )
    rng = np.random.default_rng(0)
    for start, end in ((0, 4), (3, 6)):
        with pytest.raises(ValueError, match=f"blocks {start}:{end} begin or end between blocks") as error:
            Petals22Routing().route(c, start, end, rng)
        assert "\n" not in str(error.value)
    assert Petals22Routing().route(c, 2, 6, rng) == [(0, 2, 6)]


# ---- max_throughput and the client ------------------------------------------------------------------


def random_spans(rng: random.Random, blocks: int, count: int) -> list[RemoteSpanInfo]:
    spans = []
    for index in range(count):
        start = rng.randrange(blocks)
        end = rng.randint(start + 1, blocks)
        info = ServerInfo(ServerState.ONLINE, rng.uniform(0.1, 10.0))
        spans.append(RemoteSpanInfo(PeerID(f"peer-{index}".encode()), start, end, info))
    return spans


def chain_exists(spans: list[RemoteSpanInfo], start: int, end: int, closed: frozenset[int]) -> bool:
    reached = {start}
    for block in range(start, end):
        if block in reached:
            reached |= {
                stop
                for span in spans
                if span.start <= block < span.end
                for stop in range(block + 1, min(span.end, end) + 1)
                if stop not in closed
            }
    return end in reached


@pytest.mark.parametrize("closed", [CLOSED, frozenset({1, 2, 6, 7}), frozenset({4})])
def test_max_throughput_hops_never_end_between_blocks_that_share_keys_and_values(closed):
    rng, routed = random.Random(0), 0
    for _ in range(300):
        spans = random_spans(rng, blocks=9, count=rng.randint(2, 8))
        if not chain_exists(spans, 0, 9, closed):
            continue
        route = _max_throughput(spans, 0, 9, closed)
        routed += 1
        assert route[0].start == 0 and route[-1].end == 9
        assert all(a.end == b.start for a, b in itertools.pairwise(route))
        assert not {hop.end for hop in route} & closed
        by_peer = {span.peer_id: span for span in spans}
        assert all(
            by_peer[hop.peer_id].start <= hop.start < hop.end <= by_peer[hop.peer_id].end for hop in route
        )
    assert routed > 50  # the constraint was exercised, not skipped


def manager_over(spans: list[RemoteSpanInfo], closed: frozenset[int]) -> RemoteSequenceManager:
    tiny = tiny_config("llama")
    config = get_plugin_manager().family(tiny.model_type).config_class.from_dict(tiny.to_dict())
    config.dht_prefix, config.show_route = "shared", False
    manager = RemoteSequenceManager(config, network=types.SimpleNamespace(membership=None), num_blocks=6)
    manager.closed = closed  # as ``closed_boundaries`` gives for a model whose layers 4, 5 reuse 2, 3
    manager.spans = {span.peer_id: span for span in spans}
    manager.pings = dict.fromkeys(manager.spans, 0.01)
    return manager


def test_the_client_names_the_blocks_one_server_must_hold_when_none_does():
    info = ServerInfo(ServerState.ONLINE, 1.0, inference_rps=100.0)
    head, tail = PeerID(b"head"), PeerID(b"tail")
    manager = manager_over([RemoteSpanInfo(head, 0, 4, info), RemoteSpanInfo(tail, 4, 6, info)], CLOSED)
    for mode in ("min_latency", "max_throughput"):
        with pytest.raises(MissingBlocksError, match="blocks 2:6 share keys and values") as error:
            manager._choose(0, 6, mode, None)
        assert "--block_indices 2:6" in str(error.value) and "\n" not in str(error.value)
    manager = manager_over([RemoteSpanInfo(head, 0, 4, info), RemoteSpanInfo(tail, 2, 6, info)], CLOSED)
    for mode in ("min_latency", "max_throughput"):
        route = manager._choose(0, 6, mode, None)
        assert [(span.peer_id, span.start, span.end) for span in route] == [(head, 0, 2), (tail, 2, 6)]
    with pytest.raises(ValueError, match="blocks 0:4 split blocks 2:6"):
        manager._choose(0, 4, "max_throughput", None)


# ---- placement --------------------------------------------------------------------------------------


def test_the_weakest_window_neither_begins_nor_ends_between_blocks_that_share_keys_and_values():
    levels = np.array([5.0, 5.0, 0.0, 0.0, 0.0, 0.0])
    assert weakest_window(levels, 2) == 2  # the weakest blocks, were they free to split
    assert weakest_window(levels, 2, CLOSED) == 0  # 2:4 would split 2:6
    assert weakest_window(levels, 4, CLOSED) == 2
    assert weakest_window(levels, 1, CLOSED) == 0
    view = SwarmView.from_spans(6, [(0, 2, 5.0, None)], CLOSED)
    assert OursPlacement().choose_blocks(view, 4) == range(2, 6)
    assert OursPlacement().choose_blocks(view, 2) == range(0, 2)


@pytest.mark.parametrize("seed", range(20))
def test_the_weakest_window_is_the_weakest_of_those_allowed(seed):
    rng = np.random.default_rng(seed)
    total = 10
    low = int(rng.integers(1, total))
    closed = frozenset(range(low, int(rng.integers(low, total)) + 1))
    levels = rng.integers(0, 3, total).astype(float)
    length = int(rng.choice(span_lengths(total, closed)))
    allowed = [start for start in range(total - length + 1) if not {start, start + length} & closed]
    expected = min(allowed, key=lambda start: (sorted(levels[start : start + length]), start))
    assert weakest_window(levels, length, closed) == expected


def test_a_span_length_that_fits_nowhere_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no span of 3 blocks fits without splitting blocks 2:6") as error:
        weakest_window(np.zeros(6), 3, CLOSED)
    assert "the nearest spans that fit hold 2 or 4 blocks" in str(error.value)
    assert "\n" not in str(error.value)


def test_planning_refuses_block_indices_that_split_blocks_sharing_keys_and_values():
    with pytest.raises(SettingError, match="blocks 4:6 split blocks 2:6") as error:
        check_block_indices(range(4, 6), 6, CLOSED)
    assert error.value.setting == "block_indices" and "\n" not in str(error.value)
    check_block_indices(range(2, 6), 6, CLOSED)
    check_block_indices(range(0, 2), 6, CLOSED)


def test_planning_shrinks_a_planned_count_to_a_span_that_can_be_placed():
    assert longest_placeable(3, 6, CLOSED) == 2
    assert longest_placeable(5, 6, CLOSED) == 5
    assert longest_placeable(3, 6, frozenset()) == 3


# ---- a real model: Gemma 4 with shared key-value layers (needs the gemma plugin to accept them) ------


def test_gemma4_with_shared_kv_layers_closes_the_boundaries_inside_its_group():
    from transformers import Gemma4TextConfig

    tiny = Gemma4TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 3,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=0,
    )
    config = get_plugin_manager().family("gemma4_text").config_class.from_dict(tiny.to_dict())
    config.dht_prefix = "gemma4"
    manager = RemoteSequenceManager(config, network=types.SimpleNamespace(membership=None), num_blocks=6)
    assert manager.closed == CLOSED
    settings = types.SimpleNamespace(block_indices=range(4, 6), num_blocks=None)
    with pytest.raises(SettingError, match="blocks 4:6 split blocks 2:6"):
        choose_num_blocks(settings, config, {})
    settings = types.SimpleNamespace(block_indices=None, num_blocks=3)
    with pytest.raises(SettingError, match="no span of 3 blocks fits"):
        choose_num_blocks(settings, config, {})
