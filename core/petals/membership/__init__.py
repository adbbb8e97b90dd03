"""Private swarms: peers admitted by membership certificates that a swarm authority signs.

A public swarm has none of this (its records and RPCs are byte for byte Petals' own); a peer
started with ``--swarm_authority`` is in a private swarm.

* **Authority.** ``petals swarm init DIR`` makes an Ed25519 key pair: ``DIR/authority.key`` stays
  with whoever admits peers, ``DIR/authority.pub`` goes to every peer (``--swarm_authority``).
* **Certificates.** ``petals swarm admit`` signs a small JSON document naming a libp2p peer id, a
  role (``server`` or ``client``), its issue and expiry times, a random serial and the authority's
  fingerprint. A certificate is no secret: it only tells who the members are. What makes a caller
  a member is that libp2p's handshake authenticates its peer id, and the certificate names it.
* **Revocation.** ``petals swarm revoke`` adds a serial to ``DIR/revocations.json``, a list the
  authority signs, with a version that grows by one each time. ``petals dht --revocations FILE``
  reads it every update period and stores it in the DHT under ``_petals.revocations`` (subkey: the
  version, so that an old list stored again never hides a newer one). DHT peers and servers
  republish the newest list they know, and every peer fetches it each update period
  (``SwarmMembership.refresh``): a revocation reaches everyone within one update period of being
  in the DHT. Peers never go back to an older list.
* **DHT records** (``MembershipValidator``, composed with ``bounded_msgpack``'s validator in
  ``petals.dht.create_node``). A member signs every record it writes with its libp2p identity key
  (RSA, as hivemind creates it): the value is followed by an envelope with the writer's
  certificate, public key and a signature over (key, subkey, value, expiration). A record is
  valid only if its certificate is this authority's, names the signer, has the role ``server``, is
  not revoked and lasts at least as long as the record; and if its subkey is the signer's base58
  peer id (a peer writes only its own records), except under the model index ``_petals.models``,
  whose subkeys are model prefixes any server may write. Revocation lists are valid when the
  authority signed them. hivemind validates every record a DHT peer is asked to store and every
  record a search returns: honest DHT peers never store an outsider's record, and readers never
  believe one. Servers cap their records' expiration at their certificate's, so records never
  outlive certificates; when a DHT peer learns a revocation it deletes the revoked records it holds.
  hivemind drops a whole dictionary (every server of a block) if one of its records is invalid,
  so reads made by ``petals.dht`` tolerate revoked certificates (``tolerating_revoked``): a reader
  that learned a revocation before the DHT peer that answers still sees the other servers, and
  leaves the revoked one out itself (``SwarmMembership.is_server``).
* **Serving** (``AdmissionGuard``). Every RPC of ``TransformerConnectionHandler`` enters
  ``AdmissionGuard.admitted`` first, before any tensor is decoded. The first time a peer id calls,
  the server asks that peer for its certificate over libp2p (``CERTIFICATE_PROTOCOL``, which every
  member answers), checks it against the caller's authenticated ``context.remote_id`` and
  remembers it: later calls cost a dictionary lookup. Others are refused with ``[unauthorized]``.
  Pushes from other servers (``rpc_push``) need a ``server`` certificate. Once a certificate
  expires or is revoked, its peer is refused and its open calls and streams are ended.
* **Routing.** Clients route only through servers whose records carried a valid ``server``
  certificate: ``RemoteSequenceManager.eligible``, the one place a client decides which servers it
  may use, asks ``SwarmMembership.is_server``; ``update`` refreshes the revocation list first.

Modules: ``documents`` (keys, identities, certificates, revocation lists: the files of ``petals
swarm``), ``records`` (the DHT validator), ``admission`` (the servers' guard); this one holds a
peer's ``SwarmMembership`` and ``load_membership``, which turns the options into one.

Limits: the DHT's own RPCs stay open, so an outsider that reaches a DHT peer can read the records
(servers' peer ids, addresses and block ranges; never activations) but cannot add to them. A client
session opened before a server's revocation keeps its route until it routes again.

Nothing received is unpickled: certificates and revocation lists are JSON, envelopes MessagePack,
all size-checked before parsing.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from petals.membership.admission import CERTIFICATE_PROTOCOL, AdmissionGuard, admitted
from petals.membership.documents import (
    MAX_CACHED_CERTIFICATES,
    MAX_REVOCATIONS_BYTES,
    REVOCATIONS_FILE,
    Certificate,
    Identity,
    MembershipError,
    RevocationList,
    create_authority,
    load_authority_key,
    load_authority_public_key,
    read_file,
    utc,
    verify_signed,
)
from petals.membership.records import (
    PRIVATE_SWARM_HINT,
    REVOCATIONS_KEY,
    MembershipValidator,
    PrivateSwarmDetector,
    tolerating_revoked,
)

if TYPE_CHECKING:
    from hivemind.dht import DHTNode

    from petals.network.p2p import NetworkOptions

__all__ = [
    "CERTIFICATE_PROTOCOL",
    "PRIVATE_SWARM_HINT",
    "REVOCATIONS_FILE",
    "REVOCATIONS_KEY",
    "AdmissionGuard",
    "Certificate",
    "Identity",
    "MembershipError",
    "MembershipValidator",
    "PrivateSwarmDetector",
    "RevocationList",
    "SwarmMembership",
    "admitted",
    "create_authority",
    "load_authority_key",
    "load_authority_public_key",
    "load_membership",
    "tolerating_revoked",
]

logger = logging.getLogger(__name__)


class SwarmMembership:
    """One peer's view of a private swarm: the authority, its own identity and certificate (absent on a
    bootstrap DHT peer), the newest revocation list, and the certified servers whose records it read."""

    def __init__(
        self,
        authority: Ed25519PublicKey,
        identity: Identity | None = None,
        certificate: Certificate | None = None,
    ) -> None:
        self.authority, self.identity, self.certificate = authority, identity, certificate
        self.revocations: RevocationList | None = None
        self.servers: dict[PeerID, Certificate] = {}  # writers of valid records
        self.validator = MembershipValidator(self)
        self._verified: dict[bytes, Certificate] = {}
        self._guards: weakref.WeakSet[AdmissionGuard] = weakref.WeakSet()
        self._own_problem_logged: str | None = None

    # ---- checks ----------------------------------------------------------------------------------

    def check(self, certificate: Certificate, peer_id: PeerID | str | None = None) -> None:
        """Raise ``MembershipError`` unless ``certificate`` makes ``peer_id`` a member now."""
        verify_signed(certificate.body(), certificate.signature, self.authority, "membership certificate")
        if peer_id is not None and str(peer_id) != certificate.peer_id:
            raise MembershipError(f"the certificate names peer {certificate.peer_id}, not {peer_id}")
        problem = self.problem(certificate)
        if problem is not None:
            raise MembershipError(f"the certificate of peer {certificate.peer_id} {problem}")

    def problem(self, certificate: Certificate, at: float | None = None) -> str | None:
        """Why a verified certificate no longer counts (expired, revoked), or None."""
        now = get_dht_time() if at is None else at
        if certificate.expires <= now:
            return f"expired at {utc(certificate.expires)}"
        if self.is_revoked(certificate):
            return f"was revoked (serial {certificate.serial})"
        return None

    def is_revoked(self, certificate: Certificate) -> bool:
        return self.revocations is not None and certificate.serial in self.revocations.revoked

    def verified(self, raw: bytes) -> Certificate:
        """A certificate from the network, its authority signature checked (cached by its bytes:
        every record of a server carries the same one)."""
        certificate = self._verified.get(raw)
        if certificate is None:
            certificate = Certificate.from_bytes(raw)
            verify_signed(certificate.body(), certificate.signature, self.authority, "membership certificate")
            if len(self._verified) >= MAX_CACHED_CERTIFICATES:
                self._verified.clear()
            self._verified[raw] = certificate
        return certificate

    def verified_revocations(self, raw: bytes) -> RevocationList:
        """A revocation list, its authority signature checked."""
        revocations = RevocationList.from_bytes(raw)
        verify_signed(revocations.body(), revocations.signature, self.authority, "revocation list")
        return revocations

    def is_server(self, peer_id: PeerID) -> bool:
        """Whether ``peer_id`` wrote records with a ``server`` certificate that still counts: the one
        place clients decide which servers of a private swarm they may use."""
        certificate = self.servers.get(peer_id)
        return certificate is not None and certificate.role == "server" and self.problem(certificate) is None

    def own_problem(self) -> str | None:
        """Why this peer's own certificate no longer makes it a member (then: what to do), or None."""
        if self.certificate is None:
            return None
        problem = self.problem(self.certificate)
        if problem is None:
            return None
        return (
            f"this peer's membership certificate {problem}; ask the swarm authority for a new one "
            f"(`petals swarm admit DIR --identity KEY --out CERT`) and restart with it"
        )

    def cap_expiration(self, expiration_time: float) -> float:
        """Records must not outlive the certificate that vouches for them."""
        return min(expiration_time, self.certificate.expires) if self.certificate else expiration_time

    # ---- revocations -----------------------------------------------------------------------------

    def adopt(self, revocations: RevocationList, node: DHTNode | None = None) -> bool:
        """Use ``revocations`` (verified) if it is newer than the list in use; then end what it revokes here."""
        if self.revocations is not None and revocations.version <= self.revocations.version:
            return False
        self.revocations = revocations
        logger.info(
            "Revocation list version %d: %d certificates revoked",
            revocations.version,
            len(revocations.revoked),
        )
        self.servers = {peer: cert for peer, cert in self.servers.items() if not self.is_revoked(cert)}
        self.end_lapsed()
        if node is not None:
            self._delete_revoked_records(node)
        return True

    def end_lapsed(self) -> None:
        """Every guard of this peer refuses, from now on, peers whose certificates expired or were revoked."""
        for guard in list(self._guards):
            guard.end_lapsed()

    def _delete_revoked_records(self, node: DHTNode) -> None:
        serializer = node.protocol.serializer
        deleted = 0
        for storage in (node.protocol.storage, node.protocol.cache):
            for key_id, entry in list(storage.items()):
                if not isinstance(entry.value, DictionaryDHTValue):
                    continue
                for subkey, item in list(entry.value.items()):
                    record = DHTRecord(
                        key_id.to_bytes(), serializer.dumps(subkey), item.value, item.expiration_time
                    )
                    try:
                        self.validator.check(record)
                    except MembershipError:
                        del entry.value[subkey]
                        deleted += 1
        if deleted:
            logger.info("Deleted %d DHT records of revoked certificates", deleted)

    async def refresh(self, node: DHTNode, *, republish_for: float | None = None) -> None:
        """Fetch the newest revocation list from the DHT and use it; with ``republish_for``, store the
        newest list known again for that many seconds (DHT peers and servers keep it alive)."""
        entry = await node.get(REVOCATIONS_KEY, latest=True)
        versions = entry.value if entry is not None and isinstance(entry.value, dict) else {}
        for item in versions.values():
            if isinstance(item.value, bytes):  # the validator has checked them already
                self.adopt(self.verified_revocations(item.value), node)
        self.end_lapsed()  # certificates expire between revocations too
        if republish_for is not None and self.revocations is not None:
            await self.publish(node, republish_for)
        problem = self.own_problem()
        if problem is not None and problem != self._own_problem_logged:
            logger.error("%s", problem)
        self._own_problem_logged = problem

    async def keep_fresh(
        self, node: DHTNode, period: float, republish_for: float, revocations_file: Path | None = None
    ) -> None:
        """Every ``period`` seconds: use ``revocations_file`` if it holds a newer list (``petals dht
        --revocations``), then ``refresh`` and republish. A server's or DHT peer's task; runs until cancelled."""
        while True:
            try:
                if revocations_file is not None and revocations_file.exists():
                    raw = read_file(revocations_file, "revocation list", MAX_REVOCATIONS_BYTES)
                    self.adopt(self.verified_revocations(raw), node)
                await self.refresh(node, republish_for=republish_for)
            except Exception as error:  # the next period tries again; the list in use stays
                logger.warning("Could not refresh the revocation list: %s", error)
            await asyncio.sleep(period)

    async def publish(self, node: DHTNode, seconds: float) -> bool:
        revocations = self.revocations
        return await node.store(
            REVOCATIONS_KEY, revocations.raw, get_dht_time() + seconds, subkey=revocations.version
        )

    # ---- presenting and checking certificates over RPC --------------------------------------------

    async def present_certificate(self, p2p: P2P) -> None:
        """Answer ``CERTIFICATE_PROTOCOL`` with this peer's certificate (servers ask callers for it)."""
        if self.certificate is None:
            return
        raw = self.certificate.raw

        async def certificate(request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
            return runtime_pb2.ExpertInfo(serialized_info=raw)

        await p2p.add_protobuf_handler(CERTIFICATE_PROTOCOL, certificate, runtime_pb2.ExpertUID)

    def guard(self, p2p: P2P) -> AdmissionGuard:
        guard = AdmissionGuard(self, p2p)
        self._guards.add(guard)
        return guard


def load_membership(
    options: NetworkOptions, *, certificate_required: bool = True, role: str | None = None
) -> SwarmMembership | None:
    """This peer's ``SwarmMembership`` from ``--swarm_authority``, ``--membership`` and ``--identity_path``
    (None in a public swarm), its certificate for ``role`` if given; a configuration that cannot work is
    a ``MembershipError`` saying why."""
    if options.swarm_authority is None:
        if options.membership is not None:
            raise MembershipError("--membership needs --swarm_authority: the swarm authority's authority.pub")
        return None
    authority = load_authority_public_key(options.swarm_authority)
    if options.membership is None:
        if certificate_required:
            raise MembershipError(
                "a private swarm (--swarm_authority) admits only members: pass --membership CERT and "
                "--identity_path KEY (from `petals swarm admit DIR --identity KEY --out CERT`)"
            )
        return SwarmMembership(authority)
    if options.identity_path is None:
        raise MembershipError(
            "--membership needs --identity_path: the identity file the certificate was issued for"
        )
    if not Path(options.identity_path).exists():
        raise MembershipError(
            f"--identity_path {options.identity_path} does not exist: the certificate names a key"
        )
    identity = Identity.load(options.identity_path)
    certificate = Certificate.read(options.membership)
    membership = SwarmMembership(authority, identity, certificate)
    try:
        membership.check(certificate, identity.peer_id)
    except MembershipError as error:
        raise MembershipError(
            f"--membership {options.membership} does not admit --identity_path {options.identity_path} "
            f"(peer {identity.peer_id}): {error}. Ask the authority: `petals swarm admit DIR --identity KEY --out CERT`"
        ) from None
    if role is not None and certificate.role != role:
        raise MembershipError(
            f"--membership {options.membership} certifies a {certificate.role}; a {role} needs a certificate "
            f"issued with `petals swarm admit DIR --identity KEY --role {role} --out CERT`"
        )
    return membership
