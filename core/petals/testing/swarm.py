"""Real local swarms for tests: ``petals dht`` / ``petals serve`` processes on 127.0.0.1, or the same
peers in the test's own process (``inprocess_swarm``: no process start, no torch import per server).

The runner is the product's own ``petals.local_swarm`` (``petals demo`` uses it too); this module
is where tests and plugin authors import it from, with the client options that keep a test's
client peer on 127.0.0.1.

    with start_dht() as dht, start_server(model_dir, dht.initial_peers, "--block_indices", "0:2") as server:
        ...
"""

from petals.local_swarm import (
    ApiProcess,
    DhtProcess,
    MonitorProcess,
    ServerProcess,
    SwarmProcess,
    SwarmProcessError,
    running_swarm,
    start_api,
    start_dht,
    start_monitor,
    start_server,
)
from petals.network.client import LOOPBACK_CLIENT
from petals.testing.inprocess import InProcessDht, InProcessServer, inprocess_swarm

__all__ = [
    "LOOPBACK_CLIENT",
    "ApiProcess",
    "DhtProcess",
    "InProcessDht",
    "InProcessServer",
    "MonitorProcess",
    "ServerProcess",
    "SwarmProcess",
    "SwarmProcessError",
    "inprocess_swarm",
    "running_swarm",
    "start_api",
    "start_dht",
    "start_monitor",
    "start_server",
]
