"""DHT records of a private swarm: signed by their writers, checked by every DHT peer and reader.

A member's record value is followed by an envelope: MessagePack ``[certificate, public key,
signature]``, then the envelope's length and ``ENVELOPE_MARKER``. The signature (RSA, the writer's
libp2p identity key) covers the key, subkey, value and expiration, so nothing can be moved, changed
or made to last longer. The rules a record must meet are in ``petals.membership``'s docstring.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import struct
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgpack
from cryptography.exceptions import InvalidSignature
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID

from petals.bounded_msgpack import MsgpackLimitError, check_msgpack
from petals.constants import MODEL_INDEX_KEY
from petals.membership.documents import (
    MAX_CERTIFICATE_BYTES,
    MAX_REVOCATIONS_BYTES,
    RSA_SIGNATURE,
    MembershipError,
    signer,
    utc,
)
from petals.wire_errors import cut

if TYPE_CHECKING:
    from petals.membership import SwarmMembership

logger = logging.getLogger(__name__)

REVOCATIONS_KEY = "_petals.revocations"  # DHT key; subkey: the list's version
ENVELOPE_TRAILER = struct.Struct(">I8s")  # envelope length, then the marker
ENVELOPE_MARKER = b"PTLSIG01"
_MODEL_INDEX_ID = DHTID.generate(source=MODEL_INDEX_KEY).to_bytes()
_REVOCATIONS_ID = DHTID.generate(source=REVOCATIONS_KEY).to_bytes()

_tolerate_revoked: contextvars.ContextVar[bool] = contextvars.ContextVar("tolerate_revoked", default=False)


@contextlib.contextmanager
def tolerating_revoked() -> Iterator[None]:
    """Reads inside this block accept records of revoked certificates (see the module docstring)."""
    token = _tolerate_revoked.set(True)
    try:
        yield
    finally:
        _tolerate_revoked.reset(token)


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
            self.check(record)
        except MembershipError as error:
            self._log_refusal(record, error)
            return False
        return True

    def check(self, record: DHTRecord) -> None:
        """Raise ``MembershipError`` saying why, unless ``record`` is valid in this private swarm."""
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
            public_key, writer = signer(bytes(public_key_proto))
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
                f"it lasts longer than its writer's certificate ({utc(certificate.expires)})"
            )
        if not _tolerate_revoked.get() and membership.is_revoked(certificate):
            raise MembershipError(f"the certificate of its writer {writer} was revoked")
        if record.key != _MODEL_INDEX_ID and _unpack_small(record.subkey) != writer:
            raise MembershipError(f"peer {writer} may write only its own records, not another peer's")
        try:
            public_key.verify(
                bytes(signature), _signed_message(dataclasses.replace(record, value=value)), *RSA_SIGNATURE
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


PRIVATE_SWARM_HINT = (
    "this swarm is private (its DHT records are signed by its members): join it with --swarm_authority "
    "AUTHORITY.pub --membership CERT --identity_path KEY, which its authority issues (`petals swarm admit`); "
    "from Python: from_pretrained(..., swarm_authority=..., membership=..., identity_path=...)"
)


class PrivateSwarmDetector(RecordValidatorBase):
    """For a peer started without a private swarm's options: refuses records signed by a member (which
    only a private swarm stores), the first with one WARNING line saying what to pass, the others quietly;
    ``seen`` tells whether there was one."""

    def __init__(self) -> None:
        self.seen = False

    @property
    def priority(self) -> int:
        return 20  # before bounded_msgpack's validator, which would refuse the signed value as malformed

    def validate(self, record: DHTRecord) -> bool:
        if not is_signed(record.value):
            return True
        if not self.seen:
            self.seen = True
            logger.warning("This peer ignores the swarm's records: %s", PRIVATE_SWARM_HINT)
        return False


def is_signed(value: bytes) -> bool:
    """Whether a DHT value ends in a member's envelope (``MembershipValidator.sign_value``), which makes
    it no plain MessagePack value."""
    if len(value) < ENVELOPE_TRAILER.size or not value.endswith(ENVELOPE_MARKER):
        return False
    try:
        check_msgpack(value)
    except MsgpackLimitError:
        return True
    return False


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
