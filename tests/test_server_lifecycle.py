"""A server's life as the swarm sees it: JOINING while loading, ONLINE while serving, OFFLINE after a signal."""

from __future__ import annotations

import signal
import time

import pytest

from petals.data_structures import ServerState
from petals.testing.swarm import InProcessDht, start_server
from petals.testing.wire_client import WireClient

SERVER_ARGS = ("--throughput", "1.0", "--update_period", "2")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_server_goes_joining_online_offline(tiny_model_path, signum):
    """Poll the DHT while a server starts and stops: it must pass through every state."""
    model_path = tiny_model_path("llama")
    prefix = "statewatch"
    with InProcessDht().start() as dht:
        client = WireClient(dht.initial_peers)
        try:
            server = start_server(
                model_path,
                dht.initial_peers,
                "--block_indices",
                "0:1",
                "--dht_prefix",
                prefix,
                *SERVER_ARGS,
                wait_ready=False,
            )
            states = []
            deadline = time.monotonic() + 60
            while ServerState.ONLINE not in states and time.monotonic() < deadline:
                entry = client.dht_get(f"{prefix}.0")
                if entry is not None and server.peer_id in entry.value:
                    state = ServerState(entry.value[server.peer_id].value[0])
                    if not states or states[-1] != state:
                        states.append(state)
            server.process.send_signal(signum)
            assert server.process.wait(15) == 0
            server.stop()
            offline = client.dht_get(f"{prefix}.0").value[server.peer_id].value
            states.append(ServerState(offline[0]))
        finally:
            client.close()
    assert states == [ServerState.JOINING, ServerState.ONLINE, ServerState.OFFLINE]
