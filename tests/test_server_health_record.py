"""What a server says of its cache in its DHT record, and how ``petals health`` shows it: pages held by
live sessions, lent by idle and kept ones, free, and sessions preempted. Optional keys: a record
without them (a stock Petals server's) reads as before."""

import pytest
from hivemind.p2p import PeerID

from petals.cli.health import COLUMNS, server_cells
from petals.data_structures import RecordError, RemoteSpanInfo, ServerInfo, ServerState
from petals.swarm_state import ServerRow

PAGES = {"live": 12, "kept": 3, "free": 49}


def test_cache_pages_and_preemptions_travel_as_optional_record_keys():
    info = ServerInfo(ServerState.ONLINE, 1.0, cache_pages=PAGES, sessions_preempted=4)
    state, throughput, fields = info.to_tuple()
    assert fields["cache_pages"] == PAGES and fields["sessions_preempted"] == 4
    assert ServerInfo.from_tuple((state, throughput, fields)) == info
    stock = {
        name: value for name, value in fields.items() if name not in ("cache_pages", "sessions_preempted")
    }
    parsed = ServerInfo.from_tuple((state, throughput, stock))
    assert parsed.cache_pages is None and parsed.sessions_preempted is None


@pytest.mark.parametrize(
    ("name", "value"),
    [("cache_pages", {"live": -1}), ("cache_pages", {"live": 1.5}), ("sessions_preempted", True)],
)
def test_bad_cache_fields_are_refused(name, value):
    with pytest.raises(RecordError, match=name):
        ServerInfo.from_tuple((int(ServerState.ONLINE), 1.0, {name: value}))


def test_health_shows_each_servers_pages_by_use_and_preemptions():
    peer = PeerID.from_base58("QmNtBT3Ar8vusSqEsWHd3sYh8wnXZJ6twsPGEdMYywAYhd")
    for info, pages, preempted in (
        (ServerInfo(ServerState.ONLINE, 1.0, cache_pages=PAGES, sessions_preempted=4), "12/3/49", "4"),
        (ServerInfo(ServerState.ONLINE, 1.0), "-", "-"),  # a stock Petals server says neither
    ):
        cells = dict(
            zip(COLUMNS, server_cells(ServerRow(RemoteSpanInfo(peer, 0, 2, info), "online", {})), strict=True)
        )
        assert cells["pages live/kept/free"] == pages and cells["preempted"] == preempted
