"""The files of a private swarm's authority, and what it signs: certificates and revocation lists.

Certificates and revocation lists are JSON documents the authority (Ed25519) signs over their
canonical form (sorted keys, no spaces); their ``type`` keeps one from passing for the other. Peer
identities are libp2p identity files as hivemind writes them (an RSA key in libp2p's protobuf).
Everything read is size-checked first and parsed as JSON or protobuf, never unpickled.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

from petals.wire_errors import cut

AUTHORITY_KEY = "authority.key"
AUTHORITY_PUB = "authority.pub"
REVOCATIONS_FILE = "revocations.json"
ROLES = ("server", "client")
MAX_CERTIFICATE_BYTES = 4096
MAX_REVOCATIONS_BYTES = 1 << 20
MAX_IDENTITY_BYTES = 16384
MAX_CACHED_CERTIFICATES = 4096
RSA_SIGNATURE = (padding.PKCS1v15(), hashes.SHA256())  # libp2p's RSA signature scheme


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


def verify_signed(body: dict, signature: bytes, authority: Ed25519PublicKey, kind: str) -> None:
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
        return cls.from_bytes(read_file(path, "membership certificate", MAX_CERTIFICATE_BYTES))

    def body(self) -> dict[str, Any]:
        return {"type": self.KIND, **{name: getattr(self, name) for name in self.FIELDS}}

    def describe(self) -> str:
        return f"peer {self.peer_id} as {self.role} until {utc(self.expires)} (serial {self.serial})"


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


def utc(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def read_file(path: str | os.PathLike, what: str, limit: int) -> bytes:
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
        key = serialization.load_pem_private_key(read_file(path, "authority key", 4096), password=None)
    except ValueError as error:
        raise MembershipError(f"{path} is not a PEM private key: {error}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise MembershipError(f"{path} is not an Ed25519 key made by `petals swarm init`")
    return key


def load_authority_public_key(path: str | os.PathLike) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(read_file(path, "authority public key", 4096))
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
        data = read_file(path, "identity", MAX_IDENTITY_BYTES)
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
        return cls.load(path)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message, *RSA_SIGNATURE)


def _public_key_proto(public_key: rsa.RSAPublicKey) -> bytes:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()


def _peer_id_bytes(public_key_proto: bytes) -> bytes:
    return (
        b"\x12\x20" + hashlib.sha256(public_key_proto).digest()
    )  # multihash sha2-256, as libp2p hashes RSA keys


@functools.lru_cache(maxsize=MAX_CACHED_CERTIFICATES)
def signer(public_key_proto: bytes) -> tuple[rsa.RSAPublicKey, str]:
    """A record signer's public key and base58 peer id (cached: every server signs many records)."""
    try:
        proto = crypto_pb2.PublicKey.FromString(public_key_proto)
        key = serialization.load_der_public_key(proto.data)
    except Exception:  # protobuf and DER parsers raise several kinds
        raise MembershipError("the record's public key cannot be parsed") from None
    if proto.key_type != crypto_pb2.RSA or not isinstance(key, rsa.RSAPublicKey):
        raise MembershipError("the record's public key is not an RSA libp2p key")
    return key, PeerID(_peer_id_bytes(public_key_proto)).to_base58()
