"""The servers this client caught lying (``verification``): banned for its lifetime, listed by the
model's ``suspects()``, counted for ``petals api``'s ``/metrics``."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from hivemind.p2p import PeerID

from petals.data_structures import RemoteSpanInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Suspect:
    """A server caught returning outputs that two other servers of the same blocks disagree with."""

    peer_id: str
    blocks: tuple[int, int]
    evidence: str
    checks: int  # the steps this client had verified when it caught this one


class Suspects:
    """The liars this client found (banned for its lifetime) and its verification counts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._suspects: dict[PeerID, Suspect] = {}
        self.checks = 0
        self.mismatches = 0
        self.closest_call = 0.0  # the largest error / tolerance among checks that agreed

    def __contains__(self, peer: PeerID) -> bool:
        return peer in self._suspects

    def __len__(self) -> int:
        return len(self._suspects)

    def list(self) -> list[Suspect]:
        with self._lock:
            return list(self._suspects.values())

    def count(self, error: float, limit: float) -> None:
        """One check: the two servers' relative error and the tolerance it was held to."""
        with self._lock:
            self.checks += 1
            if error > limit:
                self.mismatches += 1
            else:
                self.closest_call = max(self.closest_call, error / limit)

    def accuse(self, peer: PeerID, span: RemoteSpanInfo, evidence: str) -> None:
        with self._lock:
            if peer in self._suspects:
                return
            self._suspects[peer] = Suspect(str(peer), (span.start, span.end), evidence, self.checks)
        logger.warning(
            "Server %s returned wrong outputs for blocks %d:%d (%s); not using it again",
            peer,
            span.start,
            span.end,
            evidence,
        )
