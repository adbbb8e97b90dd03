"""Stopping ``petals serve`` and ``petals dht`` by signal, as operators and supervisors do.

A signal goes to the pid (``kill PID``) or to the whole process group (Ctrl-C in a terminal,
``timeout``, ``kill -- -PGID``; systemd's default stop reaches p2pd too). Either way the process
exits 0 within 5 s, announcing OFFLINE while the network is reachable and saying truthfully when it
is not; a second signal exits at once; p2pd never outlives it. Every process here leads its own
process group, so a group signal reaches nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil
import pytest

from petals.data_structures import ServerState
from petals.testing.swarm import InProcessDht, SwarmProcess, start_dht, start_server
from petals.testing.wire_client import WireClient

EXIT_SECONDS = 5
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
TARGETS = ("pid", "group")
CLEAN_STOPS = [(name, target) for name in SIGNALS for target in TARGETS]
# each test stops one server of its own; they all start at once (in parallel) with the module
SERVER_ROLES = [f"{name}-{target}" for name, target in CLEAN_STOPS] + [
    "daemon-killed",
    "daemon-hung",
    "twice",
]
DHT_ROLES = [f"{name}-{target}" for name, target in CLEAN_STOPS] + ["killed"]
PREFIX = "signals"


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    """A DHT, a client peer, and one ONLINE server (own process group) per test that stops one."""
    model = tiny_model_path("llama")
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        client = WireClient(dht.initial_peers)
        stack.callback(client.close)
        servers = {
            role: stack.enter_context(
                start_server(
                    model,
                    dht.initial_peers,
                    "--block_indices",
                    "0:2",
                    "--dht_prefix",
                    PREFIX,
                    "--throughput",
                    "1",
                    wait_ready=False,
                    own_process_group=True,
                )
            )
            for role in SERVER_ROLES
        }
        for server in servers.values():
            server.wait_for_log("Server is ONLINE", timeout=180)
        yield client, servers


def daemons_of(process: SwarmProcess) -> list[psutil.Process]:
    """The process's p2pd children (before it is signalled), each checked to run in a session of its own."""
    children = psutil.Process(process.pid).children()
    assert [child.name() for child in children] == ["p2pd"]
    assert all(child.pid == os.getsid(child.pid) != process.pid for child in children)
    return children


def send(process: SwarmProcess, signum: int, target: str) -> None:
    if target == "group":
        process.signal_group(signum)
    else:
        process.process.send_signal(signum)


def exit_code(process: SwarmProcess, within: float = EXIT_SECONDS) -> int:
    code = process.process.wait(within)
    process.stop()  # joins the log readers
    return code


def assert_gone(daemons: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(daemons, timeout=5)
    assert not alive, f"p2pd outlived its process: {alive}"


def server_state(client: WireClient, server) -> ServerState:
    return ServerState(client.dht_get(f"{PREFIX}.0").value[server.peer_id].value[0])


@pytest.mark.parametrize("name,target", CLEAN_STOPS)
def test_server_stops_cleanly_and_announces_offline(swarm, name, target):
    client, servers = swarm
    server = servers[f"{name}-{target}"]
    daemons = daemons_of(server)
    send(server, SIGNALS[name], target)
    assert exit_code(server) == 0, server.log
    assert f"Received {name}: shutting down" in server.log
    assert "Announced OFFLINE for blocks 0:2" in server.log
    assert "Left the swarm" in server.log
    assert server_state(client, server) == ServerState.OFFLINE
    assert_gone(daemons)


def test_server_killed_with_its_daemon_says_offline_was_not_announced(swarm):
    """systemd's default stop: SIGTERM to every process of the unit, p2pd included."""
    client, servers = swarm
    server = servers["daemon-killed"]
    daemons = daemons_of(server)
    for process in [*daemons, server.process]:
        process.send_signal(signal.SIGTERM)
    assert exit_code(server) == 0, server.log
    assert (
        "Could not announce OFFLINE for blocks 0:2: the network daemon (p2pd) is gone; the records expire in"
        in (server.log)
    )
    assert "Announced OFFLINE" not in server.log
    assert (
        server_state(client, server) == ServerState.ONLINE
    )  # as the log says: the record stays until it expires
    assert_gone(daemons)


def test_server_with_a_hung_daemon_still_exits_in_time(swarm):
    """p2pd stopped (SIGSTOP): every step waits only up to its deadline, then p2pd is killed."""
    _, servers = swarm
    server = servers["daemon-hung"]
    daemons = daemons_of(server)
    for daemon in daemons:
        daemon.suspend()
    server.process.send_signal(signal.SIGTERM)
    assert exit_code(server) == 0, server.log
    assert "Could not announce OFFLINE for blocks 0:2: no answer from the DHT within" in server.log
    assert "The network daemon (p2pd) did not stop within 1.0 s; killed it" in server.log
    assert_gone(daemons)


def test_second_signal_exits_at_once(swarm):
    """With p2pd hung the clean stop takes seconds; a second signal cuts it short with 128 + signum."""
    _, servers = swarm
    server = servers["twice"]
    daemons = daemons_of(server)
    for daemon in daemons:
        daemon.suspend()
    server.signal_group(signal.SIGTERM)
    server.wait_for_log("Received SIGTERM: shutting down", timeout=EXIT_SECONDS)
    server.signal_group(signal.SIGINT)
    assert exit_code(server, within=2) == 128 + signal.SIGINT, server.log
    assert "Received SIGINT again: exiting at once" in server.log
    assert "Left the swarm" not in server.log
    assert_gone(daemons)


@pytest.fixture(scope="module")
def dhts():
    """One bootstrap peer (own process group) per test that stops one, started at once."""
    with contextlib.ExitStack() as stack:
        dhts = {
            role: stack.enter_context(start_dht(wait_ready=False, own_process_group=True))
            for role in DHT_ROLES
        }
        for dht in dhts.values():
            dht.wait_ready(timeout=60)
        yield dhts


@pytest.mark.parametrize("name,target", CLEAN_STOPS)
def test_dht_stops_cleanly(dhts, name, target):
    dht = dhts[f"{name}-{target}"]
    daemons = daemons_of(dht)
    send(dht, SIGNALS[name], target)
    assert exit_code(dht) == 0, dht.log
    assert f"Received {name}: shutting down" in dht.log
    assert "DHT peer stopped" in dht.log
    assert_gone(daemons)


def test_dht_killed_outright_leaves_no_daemon_and_no_socket(dhts):
    """p2pd runs in a session of its own, yet exits by itself when its Python process dies; the unix
    sockets neither could remove are removed by the handle that stops it."""
    dht = dhts["killed"]
    daemons = daemons_of(dht)
    sockets = {
        connection.laddr
        for process in [psutil.Process(dht.pid), *daemons]
        for connection in process.net_connections(kind="unix")
        if "/hivemind-" in str(connection.laddr)
    }
    assert sockets  # the daemon's control socket (a server's Python process listens on one more)
    dht.process.kill()
    assert exit_code(dht) == -signal.SIGKILL
    assert_gone(daemons)
    assert not [path for path in sockets if os.path.exists(path)]
