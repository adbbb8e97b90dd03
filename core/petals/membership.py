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
  certificate (``RemoteSequenceManager.update``, which refreshes the revocation list first).

Limits: the DHT's own RPCs stay open, so an outsider that reaches a DHT peer can read the records
(servers' peer ids, addresses and block ranges; never activations) but cannot add to them. A client
session opened before a server's revocation keeps its route until it routes again.

Nothing received is unpickled: certificates and revocation lists are JSON, envelopes MessagePack,
all size-checked before parsing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import os
import secrets
import struct
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import crypto_pb2, runtime_pb2
from hivemind.utils import get_dht_time

from petals.bounded_msgpack import MsgpackLimitError, check_msgpack
from petals.constants import MODEL_INDEX_KEY
from petals.wire import UnauthorizedError, cut

if TYPE_CHECKING:
    from hivemind.dht import DHTNode

    from petals.network.p2p import NetworkOptions

logger = logging.getLogger(__name__)

AUTHORITY_KEY = "authority.key"
AUTHORITY_PUB = "authority.pub"
REVOCATIONS_FILE = "revocations.json"
REVOCATIONS_KEY = "_petals.revocations"  # DHT key; subkey: the list's version
CERTIFICATE_PROTOCOL = "PetalsMembership.certificate"  # a member answers it with its certificate
ROLES = ("server", "client")
SERVER_ONLY_METHODS = frozenset({"rpc_push"})  # calls only servers make
MAX_CERTIFICATE_BYTES = 4096
MAX_REVOCATIONS_BYTES = 1 << 20
MAX_IDENTITY_BYTES = 16384
MAX_CACHED_CERTIFICATES = 4096
ASK_TIMEOUT = 5.0  # seconds a caller has to present its certificate
ENVELOPE_TRAILER = struct.Struct(">I8s")  # envelope length, then the marker
ENVELOPE_MARKER = b"PTLSIG01"
_MODEL_INDEX_ID = DHTID.generate(source=MODEL_INDEX_KEY).to_bytes()
_REVOCATIONS_ID = DHTID.generate(source=REVOCATIONS_KEY).to_bytes()
_RSA_SIGNATURE = (padding.PKCS1v15(), hashes.SHA256())  # libp2p's RSA signature scheme


class MembershipError(ValueError):
    """A certificate, key, revocation list or record that does not make its peer a member; the
    message says why and what to do."""


# ---- signed documents: certificates and revocation lists ------------------------------------------


def fingerprint(authority: Ed25519PublicKey) -> str:
    """A short name of an authority (hex of its key's SHA-256), written into what it signs."""
    raw = authority.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _signed_json(body: dict[str, Any], authority_key: Ed25519PrivateKey) -> bytes:
    signature = base64.b64encode(authority_key.sign(_canonical(body))).decode()
    return json.dumps({**body, "signature": signature}, indent=1, sort_keys=True).encode() + b"\n"


def _read_signed_json(data: bytes, kind: str, fields: dict[str, type], limit: int) -> tuple[dict, bytes]:
    """The body and signature of a signed JSON document of ``kind``, its fields type-checked."""
    if len(data) > limit:
        raise MembershipError(f"a {kind} of {len(data)} bytes exceeds the limit of {limit}")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise MembershipError(f"not a {kind}: {cut(str(error), 80)}") from None
    if not isinstance(document, dict) or document.get("type") != kind:
        raise MembershipError(f"not a {kind} (its 'type' is not {kind!r})")
    signature = document.pop("signature", None)
    wrong = [
        name
        for name, kind_of in {**fields, "type": str}.items()
        if type(document.get(name)) is not kind_of  # exact: a bool is no int here
    ]
    if wrong or set(document) != {*fields, "type"} or not isinstance(signature, str):
        raise MembershipError(f"malformed {kind}: fields {sorted(wrong) or sorted(document)}")
    try:
        return document, base64.b64decode(signature, validate=True)
    except ValueError:
        raise MembershipError(f"malformed {kind}: its signature is not base64") from None


def _verify_signed(body: dict, signature: bytes, authority: Ed25519PublicKey, kind: str) -> None:
    if body["authority"] != fingerprint(authority):
        raise MembershipError(
            f"the {kind} was issued by authority {body['authority']}, but this swarm's authority "
            f"(--swarm_authority) is {fingerprint(authority)}"
        )
    try:
        authority.verify(signature, _canonical(body))
    except InvalidSignature:
        raise MembershipError(f"the {kind}'s signature does not match the swarm authority") from None


@dataclasses.dataclass(frozen=True)
class Certificate:
    """The authority's statement that ``peer_id`` may take part in the swarm as ``role`` until ``expires``."""

    KIND = "petals-membership-certificate"
    FIELDS = {"authority": str, "peer_id": str, "role": str, "issued": int, "expires": int, "serial": str}

    authority: str  # the issuer's fingerprint
    peer_id: str  # base58
    role: str
    issued: int  # unix seconds
    expires: int
    serial: str
    signature: bytes
    raw: bytes = dataclasses.field(repr=False, compare=False)  # as signed and sent

    @classmethod
    def issue(
        cls,
        authority_key: Ed25519PrivateKey,
        peer_id: PeerID,
        role: str,
        days: float,
        now: float | None = None,
    ) -> Certificate:
        if role not in ROLES:
            raise MembershipError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        if not days > 0:
            raise MembershipError(f"a certificate must last more than 0 days, got {days}")
        issued = int(time.time() if now is None else now)
        body = {
            "type": cls.KIND,
            "authority": fingerprint(authority_key.public_key()),
            "peer_id": peer_id.to_base58(),
            "role": role,
            "issued": issued,
            "expires": issued + max(1, round(days * 86400)),
            "serial": secrets.token_hex(16),
        }
        return cls.from_bytes(_signed_json(body, authority_key))

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        """Parse (not verify: see ``SwarmMembership.check``) a certificate."""
        body, signature = _read_signed_json(data, cls.KIND, cls.FIELDS, MAX_CERTIFICATE_BYTES)
        if body["role"] not in ROLES:
            raise MembershipError(f"malformed certificate: unknown role {cut(body['role'], 20)!r}")
        return cls(**{name: body[name] for name in cls.FIELDS}, signature=signature, raw=data)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Certificate:
        return cls.from_bytes(_read_file(path, "membership certificate", MAX_CERTIFICATE_BYTES))

    def body(self) -> dict[str, Any]:
        return {"type": self.KIND, **{name: getattr(self, name) for name in self.FIELDS}}

    def describe(self) -> str:
        return f"peer {self.peer_id} as {self.role} until {_utc(self.expires)} (serial {self.serial})"


@dataclasses.dataclass(frozen=True)
class RevocationList:
    """The certificates the authority revoked (serial → its expiry), version ``version``."""

    KIND = "petals-revocation-list"
    FIELDS = {"authority": str, "version": int, "issued": int, "revoked": dict}

    authority: str
    version: int
    issued: int
    revoked: dict[str, int]
    signature: bytes
    raw: bytes = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_bytes(cls, data: bytes) -> RevocationList:
        body, signature = _read_signed_json(data, cls.KIND, cls.FIELDS, MAX_REVOCATIONS_BYTES)
        revoked = body["revoked"]
        if not all(isinstance(serial, str) and type(expires) is int for serial, expires in revoked.items()):
            raise MembershipError("malformed revocation list: 'revoked' maps serials to expiry times")
        return cls(**{name: body[name] for name in cls.FIELDS}, signature=signature, raw=data)

    def body(self) -> dict[str, Any]:
        return {"type": self.KIND, **{name: getattr(self, name) for name in self.FIELDS}}

    def revoking(self, authority_key: Ed25519PrivateKey, certificate: Certificate) -> RevocationList:
        """The next version: this one plus ``certificate``, without entries for expired certificates."""
        now = int(time.time())
        revoked = {serial: expires for serial, expires in self.revoked.items() if expires > now}
        revoked[certificate.serial] = certificate.expires
        body = {**self.body(), "version": self.version + 1, "issued": now, "revoked": revoked}
        return RevocationList.from_bytes(_signed_json(body, authority_key))

    @classmethod
    def empty(cls, authority_key: Ed25519PrivateKey) -> RevocationList:
        body = {
            "type": cls.KIND,
            "authority": fingerprint(authority_key.public_key()),
            "version": 0,
            "issued": int(time.time()),
            "revoked": {},
        }
        return cls.from_bytes(_signed_json(body, authority_key))


def _utc(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _read_file(path: str | os.PathLike, what: str, limit: int) -> bytes:
    try:
        with open(path, "rb") as file:
            data = file.read(limit + 1)
    except OSError as error:
        raise MembershipError(f"cannot read the {what} {path}: {error.strerror or error}") from None
    if len(data) > limit:
        raise MembershipError(f"{path} is larger than a {what} can be ({limit} bytes)")
    return data


# ---- keys: the authority's and peers' libp2p identities --------------------------------------------


def create_authority(directory: str | os.PathLike) -> Path:
    """Write a new authority key pair into ``directory`` (refusing to replace one); returns the public key's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    private_path, public_path = directory / AUTHORITY_KEY, directory / AUTHORITY_PUB
    if private_path.exists() or public_path.exists():
        raise MembershipError(
            f"{directory} already holds a swarm authority; every certificate it issued depends on it. "
            "Use another directory for a new swarm"
        )
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_secret(private_path, private_pem)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return public_path


def _write_secret(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def load_authority_key(directory: str | os.PathLike) -> Ed25519PrivateKey:
    path = Path(directory) / AUTHORITY_KEY
    try:
        key = serialization.load_pem_private_key(_read_file(path, "authority key", 4096), password=None)
    except ValueError as error:
        raise MembershipError(f"{path} is not a PEM private key: {error}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise MembershipError(f"{path} is not an Ed25519 key made by `petals swarm init`")
    return key


def load_authority_public_key(path: str | os.PathLike) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(_read_file(path, "authority public key", 4096))
    except ValueError as error:
        raise MembershipError(f"{path} is not a PEM public key: {error}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise MembershipError(
            f"{path} is not a swarm authority's public key (authority.pub of `petals swarm init`)"
        )
    return key


@dataclasses.dataclass(frozen=True)
class Identity:
    """A libp2p identity file as ``--identity_path`` uses it: an RSA key, and the peer id it makes."""

    private_key: rsa.RSAPrivateKey
    public_key_proto: bytes  # libp2p's PublicKey protobuf, what the peer id hashes
    peer_id: PeerID

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        data = _read_file(path, "identity", MAX_IDENTITY_BYTES)
        try:
            proto = crypto_pb2.PrivateKey.FromString(data)
            if proto.key_type != crypto_pb2.RSA:
                raise ValueError(f"key type {proto.key_type} (only RSA identities, as hivemind makes them)")
            key = serialization.load_der_private_key(proto.data, password=None)
        except Exception as error:  # protobuf and DER parsers raise several kinds
            raise MembershipError(f"{path} is not a libp2p identity file: {cut(str(error), 120)}") from None
        public_key_proto = _public_key_proto(key.public_key())
        return cls(key, public_key_proto, PeerID(_peer_id_bytes(public_key_proto)))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> Identity:
        if not Path(path).exists():
            P2P.generate_identity(str(path))
            logger.info("Created a new identity in %s", path)
        return cls.load(path)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message, *_RSA_SIGNATURE)


def _public_key_proto(public_key: rsa.RSAPublicKey) -> bytes:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()


def _peer_id_bytes(public_key_proto: bytes) -> bytes:
    return (
        b"\x12\x20" + hashlib.sha256(public_key_proto).digest()
    )  # multihash sha2-256, as libp2p hashes RSA keys


@functools.lru_cache(maxsize=MAX_CACHED_CERTIFICATES)
def _signer(public_key_proto: bytes) -> tuple[rsa.RSAPublicKey, str]:
    """A record signer's public key and base58 peer id (cached: every server signs many records)."""
    try:
        proto = crypto_pb2.PublicKey.FromString(public_key_proto)
        key = serialization.load_der_public_key(proto.data)
    except Exception:  # protobuf and DER parsers raise several kinds
        raise MembershipError("the record's public key cannot be parsed") from None
    if proto.key_type != crypto_pb2.RSA or not isinstance(key, rsa.RSAPublicKey):
        raise MembershipError("the record's public key is not an RSA libp2p key")
    return key, PeerID(_peer_id_bytes(public_key_proto)).to_base58()


# ---- a peer's membership ---------------------------------------------------------------------------

_tolerate_revoked: contextvars.ContextVar[bool] = contextvars.ContextVar("tolerate_revoked", default=False)


@contextlib.contextmanager
def tolerating_revoked() -> Iterator[None]:
    """Reads inside this block accept records of revoked certificates (see the module docstring)."""
    token = _tolerate_revoked.set(True)
    try:
        yield
    finally:
        _tolerate_revoked.reset(token)


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
        _verify_signed(certificate.body(), certificate.signature, self.authority, "membership certificate")
        if peer_id is not None and str(peer_id) != certificate.peer_id:
            raise MembershipError(f"the certificate names peer {certificate.peer_id}, not {peer_id}")
        problem = self.problem(certificate)
        if problem is not None:
            raise MembershipError(f"the certificate of peer {certificate.peer_id} {problem}")

    def problem(self, certificate: Certificate, at: float | None = None) -> str | None:
        """Why a verified certificate no longer counts (expired, revoked), or None."""
        now = get_dht_time() if at is None else at
        if certificate.expires <= now:
            return f"expired at {_utc(certificate.expires)}"
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
            _verify_signed(
                certificate.body(), certificate.signature, self.authority, "membership certificate"
            )
            if len(self._verified) >= MAX_CACHED_CERTIFICATES:
                self._verified.clear()
            self._verified[raw] = certificate
        return certificate

    def verified_revocations(self, raw: bytes) -> RevocationList:
        """A revocation list, its authority signature checked."""
        revocations = RevocationList.from_bytes(raw)
        _verify_signed(revocations.body(), revocations.signature, self.authority, "revocation list")
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
                    if not self.validator.validate(record):
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
        """Every ``period`` seconds: use ``revocations_file`` if it changed (``petals dht --revocations``),
        then ``refresh`` and republish. A server's or DHT peer's task; runs until cancelled."""
        while True:
            try:
                if revocations_file is not None and revocations_file.exists():
                    raw = _read_file(revocations_file, "revocation list", MAX_REVOCATIONS_BYTES)
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


# ---- DHT records ----------------------------------------------------------------------------------


class MembershipValidator(RecordValidatorBase):
    """Signs this peer's records and refuses records not written by certified servers (module docstring)."""

    def __init__(self, membership: SwarmMembership) -> None:
        self.membership = membership
        self._last_refusal: dict[str, float] = {}  # writer → when its last refusal was logged

    @property
    def priority(self) -> int:
        return 20  # validated (and stripped) before bounded_msgpack's validator checks the bare value

    def sign_value(self, record: DHTRecord) -> bytes:
        membership = self.membership
        if record.key == _REVOCATIONS_ID or membership.identity is None or membership.certificate is None:
            return record.value
        signature = membership.identity.sign(_signed_message(record))
        envelope = msgpack.packb(
            [membership.certificate.raw, membership.identity.public_key_proto, signature]
        )
        return record.value + envelope + ENVELOPE_TRAILER.pack(len(envelope), ENVELOPE_MARKER)

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key == _REVOCATIONS_ID:
            return record.value
        with contextlib.suppress(MembershipError):
            return _split_envelope(record.value)[0]
        return record.value

    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
        except MembershipError as error:
            self._log_refusal(record, error)
            return False
        return True

    def _check(self, record: DHTRecord) -> None:
        membership = self.membership
        if record.key == _REVOCATIONS_ID:
            revocations = membership.verified_revocations(_unpack_bytes(record.value))
            if _unpack_small(record.subkey) != revocations.version:
                raise MembershipError("a revocation list stored under another version than its own")
            return
        value, envelope = _split_envelope(record.value)
        try:
            check_msgpack(envelope, max_depth=2, max_bytes=MAX_CERTIFICATE_BYTES + 1024)
            raw_certificate, public_key_proto, signature = msgpack.unpackb(envelope)
            public_key, writer = _signer(bytes(public_key_proto))
        except (MsgpackLimitError, ValueError, TypeError):
            raise MembershipError("its membership signature is malformed") from None
        certificate = membership.verified(bytes(raw_certificate))
        if certificate.peer_id != writer:
            raise MembershipError(
                f"peer {writer} signed it with the certificate of peer {certificate.peer_id}"
            )
        if certificate.role != "server":
            raise MembershipError(
                f"peer {writer} is certified as a {certificate.role}; only servers write records"
            )
        if certificate.expires < record.expiration_time:
            raise MembershipError(
                f"it lasts longer than its writer's certificate ({_utc(certificate.expires)})"
            )
        if not _tolerate_revoked.get() and membership.is_revoked(certificate):
            raise MembershipError(f"the certificate of its writer {writer} was revoked")
        if record.key != _MODEL_INDEX_ID and _unpack_small(record.subkey) != writer:
            raise MembershipError(f"peer {writer} may write only its own records, not another peer's")
        try:
            public_key.verify(
                bytes(signature), _signed_message(dataclasses.replace(record, value=value)), *_RSA_SIGNATURE
            )
        except (InvalidSignature, TypeError):
            raise MembershipError(f"its signature does not match its writer {writer}") from None
        membership.servers[PeerID.from_base58(writer)] = certificate

    def _log_refusal(self, record: DHTRecord, error: MembershipError) -> None:
        """One line per writer and minute: a flood of refused records must not flood the log."""
        writer = cut(repr(_unpack_small(record.subkey)), 60)
        now = time.monotonic()
        if now - self._last_refusal.get(writer, -60.0) < 60:
            return
        if len(self._last_refusal) > 1024:
            self._last_refusal.clear()
        self._last_refusal[writer] = now
        logger.warning("Refused a DHT record of a private swarm (subkey %s): %s", writer, error)


def _signed_message(record: DHTRecord) -> bytes:
    return msgpack.packb(
        [b"petals-dht-record", record.key, record.subkey, record.value, record.expiration_time]
    )


def _split_envelope(value: bytes) -> tuple[bytes, bytes]:
    """(the record's own value, the membership envelope) of a signed value."""
    if len(value) < ENVELOPE_TRAILER.size or not value.endswith(ENVELOPE_MARKER):
        raise MembershipError("it is not signed by a member of this private swarm")
    length, _ = ENVELOPE_TRAILER.unpack_from(value, len(value) - ENVELOPE_TRAILER.size)
    end = len(value) - ENVELOPE_TRAILER.size
    if length > end:
        raise MembershipError("its membership signature is malformed")
    return value[: end - length], value[end - length : end]


def _unpack_small(raw: bytes) -> Any:
    """A DHT subkey (a peer id, a prefix or a version), or None if it is not a small plain value."""
    try:
        check_msgpack(raw, max_depth=1, max_bytes=256)
        return msgpack.unpackb(raw)
    except (MsgpackLimitError, ValueError):
        return None


def _unpack_bytes(raw: bytes) -> bytes:
    """A DHT value that is one MessagePack binary (how a revocation list is stored)."""
    try:
        check_msgpack(raw, max_depth=1, max_bytes=MAX_REVOCATIONS_BYTES + 16)
        value = msgpack.unpackb(raw)
    except (MsgpackLimitError, ValueError):
        raise MembershipError("a revocation list must be stored as bytes") from None
    if not isinstance(value, bytes):
        raise MembershipError("a revocation list must be stored as bytes")
    return value


# ---- serving members only -------------------------------------------------------------------------


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
