"""Can other peers reach this one directly? Asked of other peers, which dial back on a new connection.

Wire: ``ReachabilityProtocol.rpc_check(PingRequest{peer.node_id}) -> PingResponse{available}``,
the RPC Petals' servers and bootstrap peers answer, so stock Petals peers can be asked too.

A peer answering ``rpc_check`` must not reuse the connection the question came on (that one is
open whatever the firewall says), so it starts a short-lived probe ``P2P`` that does not listen,
uses no relay and bootstraps from the asker's announced addresses: if the probe starts, it has
connected to the asker directly. A peer checks only the peer that asks (never a third party), so
nobody can make it dial addresses of their choice.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, P2PContext, P2PDaemonError, PeerID, ServicerBase
from hivemind.proto import dht_pb2

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 15.0  # seconds for the probe daemon to start and connect
ASK_TIMEOUT = PROBE_TIMEOUT + 10
MAX_PEERS_ASKED = 3


class ReachabilityProtocol(ServicerBase):
    """Answers other peers' "can you reach me directly?" by dialing back from a fresh probe."""

    def __init__(self, p2p: P2P) -> None:
        self.p2p = p2p
        self._one_probe_at_a_time = asyncio.Lock()  # a flood of checks must not start a flood of daemons

    async def rpc_check(self, request: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse:
        check_peer = PeerID(request.peer.node_id)
        if check_peer == context.local_id:
            return dht_pb2.PingResponse(available=True)
        if check_peer != context.remote_id:
            return dht_pb2.PingResponse(available=False)  # we check only the peer that asks
        async with self._one_probe_at_a_time:
            return dht_pb2.PingResponse(available=await dials_directly(self.p2p, check_peer))


async def dials_directly(p2p: P2P, peer_id: PeerID) -> bool:
    """Whether a new, relay-free connection to ``peer_id``'s announced addresses succeeds."""
    addrs = next((info.addrs for info in await p2p.list_peers() if info.peer_id == peer_id), [])
    direct = [f"{addr}/p2p/{peer_id}" for addr in addrs if "p2p-circuit" not in str(addr)]
    if not direct:
        return False
    try:
        probe = await P2P.create(
            initial_peers=direct,
            no_listen=True,
            dht_mode="client",
            use_relay=False,
            auto_nat=False,
            nat_port_map=False,
            check_if_identity_free=False,
            startup_timeout=PROBE_TIMEOUT,
        )
    except P2PDaemonError:
        return False
    await probe.shutdown()
    return True


async def check_direct_reachability(p2p: P2P, peers: list[PeerID]) -> bool | None:
    """Ask up to ``MAX_PEERS_ASKED`` of ``peers``; None when none of them answered."""
    request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=p2p.peer_id.to_bytes()))
    answers = []
    for peer in peers[:MAX_PEERS_ASKED]:
        try:
            stub = ReachabilityProtocol.get_stub(p2p, peer)
            answers.append((await stub.rpc_check(request, timeout=ASK_TIMEOUT)).available)
        except Exception as error:  # a peer without the protocol, or gone: ask the next one
            logger.debug("Peer %s did not answer the reachability check: %s", peer, error)
    if not answers:
        return None
    logger.info("Direct reachability: %d of %d peers reached this server", sum(answers), len(answers))
    return sum(answers) * 2 >= len(answers)
