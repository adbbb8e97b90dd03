"""How our peers join the libp2p network: listen/announce addresses, bootstrap peers, NAT and relays.

``petals serve``, ``petals dht`` and clients create one ``hivemind.p2p.P2P`` from a ``NetworkOptions``
(the CLI resolves its options into one in ``petals.cli.options``).
hivemind's ``P2P.create`` turns NAT port mapping (UPnP/NAT-PMP probes of the LAN gateway), AutoNAT
and circuit relays on by default; ``--loopback`` turns all of them off and listens on 127.0.0.1 only,
so a local swarm (tests, demos) sends nothing beyond the machine. That includes the check that an
``--identity_path`` is not online already, which petals makes itself with the peer's own options
(hivemind's probe turned NAT port mapping and AutoNAT on regardless).

hivemind (and with it torch) is imported only when a peer is created, so ``petals serve --help``
and option errors come back at once.

p2pd runs in a session of its own (hivemind has no option for it: ``petals.patches``), so that a signal to our process group (Ctrl-C in a terminal,
``timeout``, ``kill -- -PGID``) reaches only the Python side, which can then still announce OFFLINE
through the daemon before stopping it. p2pd exits by itself when its Python process dies. Every
call to p2pd is awaited only while it lives (``while_daemon_lives``): hivemind's control client
waits for p2pd's reply forever, even after p2pd has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import weakref
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from hivemind.dht import DHTNode
    from hivemind.p2p import P2P

logger = logging.getLogger(__name__)
T = TypeVar("T")

PUBLIC_INITIAL_PEERS = (
    "/dns/bootstrap1.petals.dev/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/dns/bootstrap2.petals.dev/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
    "/dns6/bootstrap1.petals.dev/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/dns6/bootstrap2.petals.dev/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
    "/ip4/159.89.214.152/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/ip4/159.203.156.48/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
)
ALL_INTERFACES = ("/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0")
LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


@dataclass(frozen=True)
class NetworkOptions:
    """Everything ``P2P.create`` needs to know about the network."""

    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] = ALL_INTERFACES
    announce_maddrs: Sequence[str] | None = None
    identity_path: str | None = None
    # a private swarm (petals.membership): the authority's public key and this peer's certificate
    swarm_authority: str | None = None
    membership: str | None = None
    nat_port_map: bool = True
    auto_nat: bool = True
    use_relay: bool = True
    use_auto_relay: bool = False
    startup_timeout: float = 60
    extra: dict[str, Any] = field(default_factory=dict)

    async def create_p2p(self) -> P2P:
        from hivemind.p2p import P2P
        from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

        from petals.patches import apply_patches, p2pd_exit_reason, p2pd_started_apart, remove_p2pd_socket

        apply_patches()  # before the first byte arrives: the DHT decodes with hivemind's serializer
        check_identity_file(self.identity_path)
        refuse_ports_in_use(self.host_maddrs)
        extra = dict(self.extra)
        if extra.pop("check_if_identity_free", True):
            await self.refuse_identity_in_use()
        with p2pd_started_apart() as started:
            try:
                p2p = await P2P.create(
                    initial_peers=list(self.initial_peers),
                    host_maddrs=list(self.host_maddrs),
                    announce_maddrs=list(self.announce_maddrs) if self.announce_maddrs else None,
                    identity_path=self.identity_path,
                    nat_port_map=self.nat_port_map,
                    auto_nat=self.auto_nat,
                    use_relay=self.use_relay,
                    use_auto_relay=self.use_auto_relay,
                    startup_timeout=self.startup_timeout,
                    check_if_identity_free=False,  # done above, with these options
                    **extra,
                )
            except P2PDaemonError as error:
                if started:  # reap it here: reaped after the loop closed, asyncio warns after our error line
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(started[-1].wait(), DAEMON_EXIT_SECONDS * 10)
                    remove_p2pd_socket(started[-1])
                reason = p2pd_exit_reason(started[-1]) if started else None
                if reason is None or reason in str(error):
                    raise
                raise P2PDaemonError(f"Daemon failed to start: {reason}") from error
            finally:
                _daemons.update(started)
        _daemon_of[p2p] = started[-1]
        return p2p

    async def refuse_identity_in_use(self) -> None:
        """Raise ``IdentityInUseError`` if a peer with ``identity_path``'s peer id is online in the swarm.

        hivemind checks this too (``check_if_identity_free``), but starts its probe peer with NAT port
        mapping and AutoNAT on whatever this peer was told, so that ``--loopback`` still sent UPnP and
        NAT-PMP probes to the LAN gateway. The probe here is a client-mode peer that listens nowhere and
        has this peer's own NAT and relay options; like hivemind's, it asks the swarm to connect to the
        peer id and is gone before this peer starts."""
        if not (self.identity_path and self.initial_peers and os.path.isfile(self.identity_path)):
            return  # a new identity, or no swarm to ask
        from hivemind.p2p import PeerID
        from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

        with open(self.identity_path, "rb") as file:
            peer_id = PeerID.from_identity(file.read())
        logger.info("Checking that no peer of the swarm uses the identity in %s", self.identity_path)
        probe_options = replace(
            self,
            announce_maddrs=None,
            identity_path=None,
            extra={**self.extra, "dht_mode": "client", "no_listen": True, "check_if_identity_free": False},
        )
        probe = await probe_options.create_p2p()
        try:
            await probe._client.connect(peer_id, [])  # how hivemind 1.1.12 checks: found and dialed
        except ControlFailure:
            return
        finally:
            await probe.shutdown()
        raise IdentityInUseError(
            f"--identity_path {self.identity_path} is in use: peer {peer_id} is online in this swarm "
            "already; stop that peer, or start this one with another identity file (a new path creates one)"
        )


class IdentityInUseError(RuntimeError):
    """Another online peer of the swarm has the peer id of this peer's ``--identity_path``."""


class IdentityFileError(ValueError):
    """``--identity_path`` names a file that holds no libp2p private key."""


class PortInUseError(OSError):
    """A fixed port of ``host_maddrs`` is held by another listening socket (another petals peer, say)."""


def check_identity_file(identity_path: str | None) -> None:
    """An existing ``--identity_path`` must hold a private key: p2pd and hivemind would otherwise fail
    with a protobuf traceback."""
    if not identity_path or not os.path.isfile(identity_path):
        return  # a new path: p2pd creates the identity there
    from hivemind.p2p import PeerID

    try:
        with open(identity_path, "rb") as file:
            PeerID.from_identity(file.read())
    except Exception as error:  # protobuf's DecodeError, a wrong key type, an unreadable file
        raise IdentityFileError(
            f"--identity_path {identity_path} holds no libp2p private key ({type(error).__name__}): restore the "
            "file from a backup, or give a path that does not exist yet (a new identity is created there)"
        ) from None


def refuse_ports_in_use(host_maddrs: Sequence[str]) -> None:
    """Refuse a fixed TCP port another socket listens on. p2pd binds with SO_REUSEPORT, so a second
    daemon on a port a first one serves would start too, and the kernel would split new connections
    between them: clients of the first would reach the second. A probe socket without SO_REUSEPORT
    cannot bind a port a listening socket holds (SO_REUSEADDR lets it past connections in TIME_WAIT)."""
    import socket

    for maddr in host_maddrs:
        parts = maddr.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or parts[3] in ("", "0"):
            continue
        family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((parts[1], int(parts[3])))
            except OSError as error:
                raise PortInUseError(
                    error.errno, f"port {parts[3]} of {maddr} is in use (address already in use)"
                ) from None


class DaemonGone(ConnectionError):
    """p2pd, the daemon that is this peer's connection to the network, has exited."""


# how long a p2pd whose sockets fail may take to exit, to tell its death from a glitch
DAEMON_EXIT_SECONDS = 0.5
# every p2pd started here, for kill_daemons(); an exited one is dropped with its Process object
_daemons: weakref.WeakSet[asyncio.subprocess.Process] = weakref.WeakSet()
# the p2pd of each P2P that create_p2p made
_daemon_of: weakref.WeakKeyDictionary[P2P, asyncio.subprocess.Process] = weakref.WeakKeyDictionary()


def daemon_alive(p2p: P2P) -> bool:
    """False once the p2pd that ``p2p`` started has exited (True for a daemon it did not start)."""
    process = _daemon_of.get(p2p)
    return process is None or process.returncode is None


async def while_daemon_lives(p2p: P2P, awaitable: Awaitable[T], timeout: float) -> T:
    """Await ``awaitable`` for at most ``timeout`` s (``TimeoutError``), or until p2pd exits (``DaemonGone``)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    process = _daemon_of.get(p2p)
    exited = asyncio.ensure_future(process.wait()) if process is not None else loop.create_future()
    try:
        await asyncio.wait({task, exited}, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            try:
                return task.result()
            except OSError as error:  # a socket to p2pd failed: say so if p2pd is exiting
                await asyncio.wait({exited}, timeout=DAEMON_EXIT_SECONDS)
                if exited.done():
                    raise DaemonGone("the network daemon (p2pd) has exited") from error
                raise
        if exited.done():
            raise DaemonGone("the network daemon (p2pd) has exited")
        raise TimeoutError(f"no answer within {timeout:.1f} s")
    finally:
        task.cancel()
        exited.cancel()


async def leave_network(p2p: P2P, node: DHTNode | None, timeout: float = 1.0) -> None:
    """Stop the DHT node and p2pd within about ``timeout`` s, killing p2pd if it does not stop in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if not daemon_alive(p2p):
        logger.info("The network daemon (p2pd) had already exited")
    elif node is not None:
        try:  # unregisters the DHT's handlers from p2pd
            await while_daemon_lives(p2p, node.shutdown(), (deadline - loop.time()) / 2)
        except Exception as error:  # p2pd is stopped below anyway
            logger.debug("DHT node shutdown skipped: %s", error)
    try:
        await asyncio.wait_for(p2p.shutdown(), max(deadline - loop.time(), 0.1))
    except TimeoutError:
        process = _daemon_of.get(p2p)
        if process is None:
            raise
        logger.warning("The network daemon (p2pd) did not stop within %.1f s; killed it", timeout)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await asyncio.wait_for(process.wait(), 1)


def kill_daemons() -> None:
    """SIGKILL every p2pd this process started that still runs: before ``os._exit``, as a hung one would stay.

    Safe from any thread (plain ``os.kill``, unlike asyncio's ``Process.kill``).
    """
    for process in list(_daemons):
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
