"""A private swarm's servers serve members only: ``AdmissionGuard`` (see ``petals.membership``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from petals.membership.documents import Certificate, MembershipError
from petals.wire_errors import UnauthorizedError, cut

if TYPE_CHECKING:
    from petals.membership import SwarmMembership

logger = logging.getLogger(__name__)

CERTIFICATE_PROTOCOL = "PetalsMembership.certificate"  # a member answers it with its certificate
SERVER_ONLY_METHODS = frozenset({"rpc_push"})  # calls only servers make
ASK_TIMEOUT = 5.0  # seconds a caller has to present its certificate


def admitted(
    guard: AdmissionGuard | None, peer_id: PeerID, method: str
) -> contextlib.AbstractAsyncContextManager[None]:
    """``guard.admitted(peer_id, method)``, or nothing to check in a public swarm (no guard)."""
    return contextlib.nullcontext() if guard is None else guard.admitted(peer_id, method)


class AdmissionGuard:
    """A server's door: which callers are members (see the module docstring, "Serving")."""

    def __init__(self, membership: SwarmMembership, p2p: P2P) -> None:
        self.membership, self.p2p = membership, p2p
        self._admitted: dict[PeerID, Certificate] = {}
        self._asking: dict[PeerID, asyncio.Future] = {}
        self._calls: dict[PeerID, set[asyncio.Task]] = {}

    @contextlib.asynccontextmanager
    async def admitted(self, peer_id: PeerID, method: str) -> AsyncIterator[None]:
        """Raise ``UnauthorizedError`` unless ``peer_id`` is a member that may call ``method``; the call
        is ended (cancelled) if the caller's certificate lapses meanwhile."""
        certificate = self._admitted.get(peer_id)
        if certificate is None or self.membership.problem(certificate) is not None:
            certificate = await self._ask(peer_id)
        if method in SERVER_ONLY_METHODS and certificate.role != "server":
            raise UnauthorizedError(
                f"{method} is for servers; peer {peer_id} is certified as a {certificate.role}"
            )
        task = asyncio.current_task()
        calls = self._calls.setdefault(peer_id, set())
        calls.add(task)
        try:
            yield
        finally:
            calls.discard(task)
            if not calls and self._calls.get(peer_id) is calls:
                del self._calls[peer_id]

    async def _ask(self, peer_id: PeerID) -> Certificate:
        """The caller's certificate, asked once however many of its calls wait for it."""
        self._admitted.pop(peer_id, None)
        asking = self._asking.get(peer_id)
        if asking is None:
            asking = self._asking[peer_id] = asyncio.ensure_future(self._fetch(peer_id))
            asking.add_done_callback(functools.partial(self._asked, peer_id))
        certificate = await asyncio.shield(asking)
        self._admitted[peer_id] = certificate
        return certificate

    def _asked(self, peer_id: PeerID, asking: asyncio.Future) -> None:
        self._asking.pop(peer_id, None)
        if not asking.cancelled():
            asking.exception()  # retrieved: a refusal nobody waits for any more is not an asyncio warning

    async def _fetch(self, peer_id: PeerID) -> Certificate:
        try:
            response = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(
                    peer_id, CERTIFICATE_PROTOCOL, runtime_pb2.ExpertUID(), runtime_pb2.ExpertInfo
                ),
                ASK_TIMEOUT,
            )
            certificate = self.membership.verified(response.serialized_info)
            self.membership.check(certificate, peer_id)
        except MembershipError as error:
            raise UnauthorizedError(f"this private swarm serves members only: {error}") from None
        except Exception as error:  # no answer: an outsider, or a peer started without --membership
            raise UnauthorizedError(
                f"this private swarm serves members only, and peer {peer_id} presented no membership "
                f"certificate ({cut(str(error) or type(error).__name__, 200)}); start it with --swarm_authority, "
                "--membership and --identity_path"
            ) from None
        return certificate

    def end_lapsed(self) -> None:
        """Forget callers whose certificates expired or were revoked, and cancel their calls and streams."""
        for peer_id, certificate in list(self._admitted.items()):
            problem = self.membership.problem(certificate)
            if problem is None:
                continue
            del self._admitted[peer_id]
            calls = self._calls.pop(peer_id, set())
            logger.info(
                "Peer %s is no longer a member (its certificate %s): ended %d calls",
                peer_id,
                problem,
                len(calls),
            )
            for task in calls:
                task.cancel()
