"""Block choice for --num_blocks servers: the weakest-covered range first, and no pointless moves."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID

from petals.data_structures import RemoteModuleInfo, ServerInfo, ServerState, make_uids
from petals.server.block_selection import choose_best_blocks, choose_best_start, choose_new_blocks
from petals.testing.swarm import InProcessDht, InProcessServer
from petals.testing.wire_client import WireClient

PREFIX = "selection"


def swarm_infos(total: int, spans: dict[str, tuple[int, int, float]]) -> list[RemoteModuleInfo]:
    infos = [RemoteModuleInfo(uid) for uid in make_uids(PREFIX, 0, total)]
    for name, (start, end, throughput) in spans.items():
        info = ServerInfo(ServerState.ONLINE, throughput, start_block=start, end_block=end)
        for index in range(start, end):
            infos[index].servers[PeerID(name.encode())] = info
    return infos


def test_best_start_is_the_weakest_window_with_ties_to_the_lowest_index():
    assert choose_best_start([0.0, 0.0, 0.0, 0.0], 2) == 0
    assert choose_best_start([2.0, 2.0, 1.0, 1.0], 2) == 2
    assert choose_best_start([1.0, 0.0, 0.0, 1.0], 1) == 1


def test_new_servers_fill_the_model_without_overlap():
    assert choose_best_blocks(2, swarm_infos(4, {})) == range(0, 2)
    assert choose_best_blocks(2, swarm_infos(4, {"a": (0, 2, 1.0)})) == range(2, 4)
    assert choose_best_blocks(1, swarm_infos(4, {"a": (0, 2, 2.0), "b": (2, 4, 1.0)})) == range(2, 3)


def test_offline_servers_do_not_count():
    infos = swarm_infos(4, {"a": (0, 2, 1.0)})
    for info in infos[:2]:
        info.servers[PeerID(b"a")].state = ServerState.OFFLINE
    assert choose_best_blocks(2, infos) == range(0, 2)


def test_no_move_when_the_best_range_is_the_current_one():
    balanced = swarm_infos(4, {"a": (0, 2, 1.0), "b": (2, 4, 1.0)})
    assert choose_new_blocks(PeerID(b"a"), balanced, balance_quality=0.75) is None
    assert (
        choose_new_blocks(PeerID(b"a"), balanced, balance_quality=2.0) is None
    )  # even when forced (bug #389)


def test_move_when_the_swarm_would_be_much_faster():
    crowded = swarm_infos(4, {"a": (0, 2, 1.0), "b": (0, 2, 1.0), "c": (2, 4, 0.1)})
    assert choose_new_blocks(PeerID(b"a"), crowded, balance_quality=0.75) == range(2, 4)
    assert choose_new_blocks(PeerID(b"a"), crowded, balance_quality=0) is None


def test_leaving_a_block_uncovered_is_not_a_move():
    alone = swarm_infos(4, {"a": (0, 2, 1.0), "c": (2, 4, 0.1)})
    assert choose_new_blocks(PeerID(b"a"), alone, balance_quality=0.75) is None


@pytest.fixture(scope="module")
def dht():
    with InProcessDht().start() as dht:
        yield dht


def test_servers_spread_over_the_model(dht, tiny_model_path):
    model = tiny_model_path("llama")
    common = ("--dht_prefix", PREFIX, "--mean_balance_check_period", "600")
    servers = []
    try:
        for num_blocks, throughput in [("2", "2.0"), ("2", "1.0"), ("1", "1.0")]:
            args = ("--num_blocks", num_blocks, "--throughput", throughput, *common)
            servers.append(InProcessServer(model, dht.initial_peers, *args).start())  # each sees the last
        client = WireClient(dht.initial_peers)
        try:
            infos = client.module_infos(make_uids(PREFIX, 0, 4))
        finally:
            client.close()
        ranges = {
            server.peer_id: {
                index
                for index, info in enumerate(infos)
                if PeerID.from_base58(server.peer_id) in info.servers
            }
            for server in servers
        }
        assert [ranges[server.peer_id] for server in servers] == [{0, 1}, {2, 3}, {2}]
    finally:
        for server in servers:
            server.stop()
