"""Certificates, revocation lists and the DHT record rules of private swarms, in-process (no network).
The same rules run in real processes in ``test_private_swarm.py``."""

from __future__ import annotations

import dataclasses
import json
import time

import msgpack
import pytest
from click.testing import CliRunner
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from petals.bounded_msgpack import make_record_validator
from petals.cli import main as petals_cli
from petals.constants import MODEL_INDEX_KEY
from petals.data_structures import ServerInfo, ServerState
from petals.membership import (
    REVOCATIONS_KEY,
    Certificate,
    Identity,
    MembershipError,
    RevocationList,
    SwarmMembership,
    create_authority,
    load_authority_key,
    load_membership,
    tolerating_revoked,
)
from petals.network.p2p import NetworkOptions

BLOCK_KEY = DHTID.generate(source="tiny-llama-hf.0").to_bytes()


@pytest.fixture(scope="module")
def authority(tmp_path_factory):
    directory = tmp_path_factory.mktemp("authority")
    create_authority(directory)
    return directory, load_authority_key(directory)


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    directory = tmp_path_factory.mktemp("identities")
    return {
        name: Identity.load_or_create(directory / f"{name}.key") for name in ("server", "other", "client")
    }


def member(authority, identity: Identity, role: str = "server", days: float = 1) -> SwarmMembership:
    _, key = authority
    return SwarmMembership(key.public_key(), identity, Certificate.issue(key, identity.peer_id, role, days))


def record(membership: SwarmMembership, subkey: str, key: bytes = BLOCK_KEY, lasts: float = 60) -> DHTRecord:
    """A server record as ``membership``'s peer writes it: value signed, as hivemind's store signs it."""
    value = MSGPackSerializer.dumps(ServerInfo(ServerState.ONLINE, 1.0).to_tuple())
    unsigned = DHTRecord(key, MSGPackSerializer.dumps(subkey), value, time.time() + lasts)
    return DHTRecord(
        unsigned.key, unsigned.subkey, validator(membership).sign_value(unsigned), unsigned.expiration_time
    )


def validator(membership: SwarmMembership) -> CompositeValidator:
    """What ``petals.dht.create_node`` composes."""
    return CompositeValidator([make_record_validator(), membership.validator])


def test_a_certificate_admits_its_peer_only_while_valid_and_not_revoked(authority, identities):
    _, key = authority
    server = member(authority, identities["server"])
    certificate = server.certificate
    server.check(certificate, identities["server"].peer_id)
    with pytest.raises(MembershipError, match="names peer .*, not"):
        server.check(certificate, identities["other"].peer_id)
    expired = Certificate.issue(
        key, identities["server"].peer_id, "server", days=1, now=time.time() - 2 * 86400
    )
    with pytest.raises(MembershipError, match="expired at"):
        server.check(expired)
    server.adopt(RevocationList.empty(key).revoking(key, certificate))
    with pytest.raises(MembershipError, match="was revoked"):
        server.check(certificate)


def test_a_tampered_or_foreign_certificate_is_refused(authority, identities, tmp_path):
    server = member(authority, identities["server"], role="client")
    document = json.loads(server.certificate.raw)
    document["role"] = "server"
    with pytest.raises(MembershipError, match="signature does not match"):
        server.check(Certificate.from_bytes(json.dumps(document).encode()))
    create_authority(tmp_path)
    foreign = member((tmp_path, load_authority_key(tmp_path)), identities["server"])
    with pytest.raises(MembershipError, match="issued by authority .* this swarm's authority"):
        server.check(foreign.certificate)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"{" * 5000, "exceeds the limit"),
        (b"[1, 2", "not a petals-membership-certificate"),
        (b'{"type": "petals-revocation-list"}', "not a petals-membership-certificate"),
        (b'{"type": "petals-membership-certificate", "issued": true}', "malformed"),
    ],
    ids=["oversized", "not-json", "another-document", "wrong-fields"],
)
def test_malformed_certificates_are_refused_before_use(data, message):
    with pytest.raises(MembershipError, match=message):
        Certificate.from_bytes(data)


def test_a_server_record_is_valid_only_as_its_writers_own_and_signed(authority, identities):
    server = member(authority, identities["server"])
    peer = identities["server"].peer_id.to_base58()
    signed = record(server, peer)
    reader = validator(SwarmMembership(server.authority))
    assert reader.validate(signed)
    assert reader.strip_value(signed) == MSGPackSerializer.dumps(
        ServerInfo(ServerState.ONLINE, 1.0).to_tuple()
    )
    assert identities["server"].peer_id in reader._validators[-1].membership.servers

    other_peer = identities["other"].peer_id.to_base58()
    assert not reader.validate(record(server, other_peer))  # someone else's subkey
    assert reader.validate(
        record(server, "tiny-llama-hf", key=DHTID.generate(source=MODEL_INDEX_KEY).to_bytes())
    )
    original = reader.strip_value(signed)
    boasting = MSGPackSerializer.dumps(ServerInfo(ServerState.ONLINE, 1e6).to_tuple())
    forged = DHTRecord(
        signed.key, signed.subkey, boasting + signed.value[len(original) :], signed.expiration_time
    )
    assert not reader.validate(forged)  # the value changed after signing
    assert not reader.validate(DHTRecord(signed.key, signed.subkey, original, signed.expiration_time))


def test_clients_and_certificates_shorter_than_the_record_write_nothing(authority, identities):
    reader = validator(SwarmMembership(authority[1].public_key()))
    client = member(authority, identities["client"], role="client")
    assert not reader.validate(record(client, identities["client"].peer_id.to_base58()))
    brief = member(authority, identities["other"], days=30 / 86400)
    assert reader.validate(record(brief, identities["other"].peer_id.to_base58(), lasts=10))
    assert not reader.validate(record(brief, identities["other"].peer_id.to_base58(), lasts=60))
    assert brief.cap_expiration(time.time() + 60) == brief.certificate.expires


def test_revoked_writers_are_refused_except_by_reads_that_filter_them_themselves(authority, identities):
    _, key = authority
    server = member(authority, identities["server"])
    signed = record(server, identities["server"].peer_id.to_base58())
    reader_membership = SwarmMembership(key.public_key())
    reader = validator(reader_membership)
    assert reader.validate(signed) and reader_membership.is_server(identities["server"].peer_id)
    reader_membership.adopt(RevocationList.empty(key).revoking(key, server.certificate))
    assert not reader.validate(signed)
    with tolerating_revoked():
        assert reader.validate(signed)
    assert not reader_membership.is_server(identities["server"].peer_id)


def test_only_the_authority_writes_revocation_lists_and_newer_ones_win(authority, identities, tmp_path):
    _, key = authority
    server = member(authority, identities["server"])
    first = RevocationList.empty(key).revoking(key, server.certificate)
    second = first.revoking(key, member(authority, identities["other"]).certificate)
    reader = validator(SwarmMembership(key.public_key()))
    revocations_key = DHTID.generate(source=REVOCATIONS_KEY).to_bytes()

    def stored(revocations: RevocationList, version: int) -> DHTRecord:
        return DHTRecord(
            revocations_key, msgpack.packb(version), msgpack.packb(revocations.raw), time.time() + 60
        )

    assert reader.validate(stored(second, 2))
    assert not reader.validate(stored(second, 1))  # under another version than its own
    create_authority(tmp_path)
    foreign_key = load_authority_key(tmp_path)
    assert not reader.validate(
        stored(RevocationList.empty(foreign_key).revoking(foreign_key, server.certificate), 1)
    )
    assert server.adopt(second) and not server.adopt(first)
    assert server.revocations.version == 2 and len(server.revocations.revoked) == 2


def test_a_membership_that_cannot_work_fails_at_start_with_what_to_do(authority, tmp_path):
    directory, key = authority
    identity = Identity.load_or_create(tmp_path / "server.key")
    certificate = Certificate.issue(key, identity.peer_id, "server", days=1)
    (tmp_path / "server.cert").write_bytes(certificate.raw)
    options = NetworkOptions(
        swarm_authority=str(directory / "authority.pub"), membership=str(tmp_path / "server.cert")
    )
    with pytest.raises(MembershipError, match="needs --identity_path"):
        load_membership(options)
    (tmp_path / "other.key").write_bytes(b"not a key")
    with pytest.raises(MembershipError, match="not a libp2p identity file"):
        load_membership(dataclasses.replace(options, identity_path=str(tmp_path / "other.key")))
    valid = dataclasses.replace(options, identity_path=str(tmp_path / "server.key"))
    assert load_membership(valid).certificate == certificate
    with pytest.raises(MembershipError, match="certifies a server; a client needs"):
        load_membership(valid, role="client")
    with pytest.raises(MembershipError, match="admits only members"):
        load_membership(NetworkOptions(swarm_authority=str(directory / "authority.pub")))
    assert load_membership(NetworkOptions()) is None


def test_petals_serve_with_someone_elses_certificate_ends_in_one_line(authority, identities, tmp_path):
    directory, key = authority
    runner = CliRunner()
    result = runner.invoke(
        petals_cli,
        [
            "swarm",
            "admit",
            str(directory),
            "--identity",
            str(tmp_path / "a.key"),
            "--out",
            str(tmp_path / "a.cert"),
        ],
    )
    assert result.exit_code == 0 and "Admitted peer Qm" in result.output, result.output
    runner.invoke(
        petals_cli,
        [
            "swarm",
            "admit",
            str(directory),
            "--identity",
            str(tmp_path / "b.key"),
            "--out",
            str(tmp_path / "b.cert"),
        ],
    )
    result = runner.invoke(
        petals_cli,
        ["serve", str(tmp_path), "--new_swarm", "--loopback", "--swarm_authority", str(directory / "authority.pub"),
         "--membership", str(tmp_path / "a.cert"), "--identity_path", str(tmp_path / "b.key")],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: --membership") and "does not admit" in result.output
    assert "Traceback" not in result.output
