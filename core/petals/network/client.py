"""The client's door to the swarm: one hivemind ``P2P`` and a client-mode ``DHTNode``.

Both live in one asyncio event loop on one background thread of the client process (no forked DHT
process). Synchronous code (torch modules, ``generate``) hands coroutines to that loop with ``run``.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from hivemind.dht import DHTNode
from hivemind.p2p import P2P

from petals.dht import create_node
from petals.membership import PrivateSwarmDetector, SwarmMembership, load_membership
from petals.network.p2p import LOOPBACK_MADDRS, NetworkOptions

T = TypeVar("T")

# the ClientConfig fields an in-process client peer passes to stay on this machine: 127.0.0.1 only,
# no NAT port mapping, AutoNAT or relays (what ``--loopback`` means for a client)
LOOPBACK_CLIENT = {
    "host_maddrs": list(LOOPBACK_MADDRS),
    "nat_port_map": False,
    "auto_nat": False,
    "use_relay": False,
}


class SwarmUnreachableError(ConnectionError):
    """None of the initial peers could be reached."""


class ClientNetwork:
    """A running ``P2P`` + ``DHTNode`` pair and the event loop thread they live in; ``membership`` is
    this client's ``SwarmMembership`` in a private swarm (else None)."""

    membership: SwarmMembership | None

    def __init__(self, options: NetworkOptions) -> None:
        if not options.initial_peers:
            raise ValueError("initial_peers is empty: pass the multiaddrs of at least one peer of the swarm")
        self.options = options
        self.membership = load_membership(options)
        self.private_swarm = (
            PrivateSwarmDetector()
        )  # says whether a private swarm's records came (no membership)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="petals-client-network", daemon=True
        )
        self._thread.start()
        try:
            self.p2p: P2P = self.run(options.create_p2p(), options.startup_timeout)
            self.node: DHTNode = self.run(
                create_node(
                    self.p2p, options.initial_peers, self.membership, self.private_swarm, client_mode=True
                ),
                options.startup_timeout,
            )
            if self.membership is not None:
                self.run(self.membership.present_certificate(self.p2p), options.startup_timeout)
        except Exception as error:
            self._stop_loop()
            peers = ", ".join(options.initial_peers)
            raise SwarmUnreachableError(
                f"cannot join the swarm through initial_peers [{peers}]: {type(error).__name__}: {error}. "
                "Check that these peers are running and reachable from this machine."
            ) from error
        self._finalizer = weakref.finalize(self, _shutdown, self.loop, self._thread, self.p2p, self.node)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the network loop and wait for its result (from any other thread).

        If the wait ends early (timeout, Ctrl-C), the coroutine is cancelled rather than left running.
        """
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        self._finalizer()

    def _stop_loop(self) -> None:
        stop_event_loop(self.loop, self._thread, cancel_other_tasks())


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, p2p: P2P, node: DHTNode) -> None:
    stop_event_loop(loop, thread, leave_swarm(node, p2p))


async def leave_swarm(node: DHTNode, p2p: P2P) -> None:
    """Shut down a DHT node and its p2p daemon, then end every other task of the running loop.

    hivemind leaves background tasks behind (DHT refreshes, daemon readers); cancelled and awaited
    here, none is "destroyed but pending" when the loop goes away.
    """
    try:
        await node.shutdown()
        await p2p.shutdown()
    finally:
        await cancel_other_tasks()


async def cancel_other_tasks() -> None:
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def stop_event_loop(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, last: Coroutine[Any, Any, Any]
) -> None:
    """Run ``last`` on ``loop`` (best effort, 10 s), then stop the loop, join its thread and close it."""
    if not loop.is_running():
        last.close()
        return
    try:
        asyncio.run_coroutine_threadsafe(last, loop).result(10)
    except Exception:  # best effort: the daemon dies with the process anyway
        asyncio.run_coroutine_threadsafe(cancel_other_tasks(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    if not thread.is_alive():
        loop.close()


def network_options(config: Any) -> NetworkOptions:
    """The client's ``NetworkOptions`` from a Distributed*Config (``ClientConfig`` fields)."""
    return NetworkOptions(
        initial_peers=tuple(config.initial_peers),
        host_maddrs=tuple(config.host_maddrs),
        nat_port_map=config.nat_port_map,
        auto_nat=config.auto_nat,
        use_relay=config.use_relay,
        startup_timeout=config.daemon_startup_timeout,
        identity_path=config.identity_path,
        swarm_authority=config.swarm_authority,
        membership=config.membership,
    )
