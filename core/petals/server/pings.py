"""``next_pings``: how far this server is from the servers a client may go to after it.

Every announcement, the server pings (an empty ``rpc_info``) the ONLINE servers hosting the block
right after its span, smooths the round-trip times and announces them in ``ServerInfo.next_pings``
(base58 peer id → seconds; ``inf`` when unreachable). Clients' min-latency routing uses them as the
cost of switching servers there, as Petals does.
"""

from __future__ import annotations

import asyncio
import math

from hivemind.dht import DHTNode
from hivemind.p2p import P2P

from petals.data_structures import ServerState
from petals.dht import get_remote_module_infos
from petals.network.rpc import ping

MAX_PINGED = 5  # next servers pinged per announcement
PING_TIMEOUT = 2.0
SMOOTHING = 0.5  # weight of the newest measurement in the moving average


class NextPings:
    """Smoothed RTTs to the next servers after blocks ``[.., end)`` of ``dht_prefix``."""

    def __init__(self, p2p: P2P, next_uid: str | None) -> None:
        self.p2p, self.next_uid = p2p, next_uid  # None: this span ends the model, nobody comes next
        self.rtts: dict[str, float] = {}

    async def refresh(self, node: DHTNode) -> dict[str, float]:
        """Ping the current next servers and return the announced dict (empty when there are none)."""
        if self.next_uid is None:
            return {}
        (info,) = await get_remote_module_infos(node, [self.next_uid], latest=True)
        peers = [
            peer
            for peer, server in info.servers.items()
            if server.state == ServerState.ONLINE and peer != self.p2p.peer_id
        ][:MAX_PINGED]
        rtts = await asyncio.gather(*(ping(self.p2p, peer, PING_TIMEOUT) for peer in peers))
        self.rtts = {
            peer.to_base58(): self._smoothed(peer.to_base58(), rtt)
            for peer, rtt in zip(peers, rtts, strict=True)
        }
        return dict(self.rtts)

    def _smoothed(self, peer: str, rtt: float) -> float:
        previous = self.rtts.get(peer)
        if previous is None or math.isinf(previous) or math.isinf(rtt):
            return float(rtt)
        return SMOOTHING * rtt + (1 - SMOOTHING) * previous
