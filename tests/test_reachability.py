"""Whether a peer can be reached directly is asked of another peer, which dials back on a new connection.

Servers ask only when they have a non-loopback address; on 127.0.0.1 (every test swarm) the
question is shown through ``check_direct_reachability`` itself, asking a real bootstrap peer (what
``petals dht`` runs, here in the test process).
"""

from __future__ import annotations

import asyncio
import time

from hivemind.p2p import P2P, PeerID

from petals.reachability import check_direct_reachability
from petals.testing.swarm import LOOPBACK_CLIENT, InProcessDht, start_server
from petals.testing.wire_client import WireClient

ARGS = (
    "--dht_prefix",
    "reach",
    "--block_indices",
    "0:1",
    "--throughput",
    "1",
    "--update_period",
    "2",
    "--torch_dtype",
    "float32",
)


def announced_info(client: WireClient, key: str, peer_id: str) -> dict:
    entry = client.dht_get(key)
    assert entry is not None and peer_id in entry.value
    return entry.value[peer_id].value[2]


def test_a_loopback_server_asks_nobody_and_announces_no_relay(tiny_model_path):
    """On 127.0.0.1 only this machine can connect, so there is nothing to ask another peer."""
    with (
        InProcessDht().start() as dht,
        start_server(tiny_model_path("llama"), dht.initial_peers, *ARGS) as server,
    ):
        time.sleep(2.5)  # one update period after ONLINE
        client = WireClient(dht.initial_peers)
        try:
            assert announced_info(client, "reach.0", server.peer_id)["using_relay"] is False
        finally:
            client.close()
        assert "Direct reachability" not in server.log


def test_a_peer_that_does_not_listen_is_not_reachable_directly():
    """A peer that only dials out (no listening socket) asks the bootstrap peer, which cannot dial back."""

    async def ask(initial_peers: list[str], no_listen: bool) -> bool | None:
        options = {**LOOPBACK_CLIENT, "host_maddrs": [] if no_listen else LOOPBACK_CLIENT["host_maddrs"]}
        peer = await P2P.create(initial_peers=initial_peers, no_listen=no_listen, **options)
        try:
            bootstrap = PeerID.from_base58(initial_peers[0].rsplit("/", 1)[1])
            return await check_direct_reachability(peer, [bootstrap])
        finally:
            await peer.shutdown()

    with InProcessDht().start() as dht:
        assert asyncio.run(ask(dht.initial_peers, no_listen=True)) is False
        assert asyncio.run(ask(dht.initial_peers, no_listen=False)) is True
