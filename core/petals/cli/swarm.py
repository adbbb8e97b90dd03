"""``petals swarm init|admit|revoke``: run a private swarm's authority (see ``petals.membership``).

    petals swarm init DIR
    petals swarm admit DIR --identity server1.key --role server --days 30 --out server1.cert
    petals swarm admit DIR --peer_id QmPeer --role client --out alice.cert
    petals swarm revoke DIR alice.cert

Every command works on files only: nothing here joins a swarm. Revocations reach the swarm through a
``petals dht --swarm_authority DIR/authority.pub --revocations DIR/revocations.json``.
"""

from __future__ import annotations

from pathlib import Path

import click

from petals.cli.errors import PetalsCommand
from petals.cli.options import exclusive, option

DIRECTORY = click.argument("directory", type=click.Path(file_okay=False, path_type=Path))


@click.group("swarm")
def swarm_command() -> None:
    """Create a private swarm's authority, admit peers to it, revoke them."""


@swarm_command.command("init", cls=PetalsCommand)
@DIRECTORY
def init_command(directory: Path) -> None:
    """Create a swarm authority (an Ed25519 key pair) in DIRECTORY."""
    from petals.membership import create_authority

    public = create_authority(directory)
    click.echo(f"Created the authority of a private swarm in {directory}.")
    click.echo(f"Give {public} to every peer (--swarm_authority); keep {directory / 'authority.key'} secret.")


@swarm_command.command("admit", cls=PetalsCommand)
@DIRECTORY
@option(
    "--identity",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The peer's identity file (as --identity_path uses it); created if missing.",
)
@option("--peer_id", help="Certify this peer id instead (a peer whose key you do not hold).")
@option("--role", type=click.Choice(["server", "client"]), default="server", show_default=True)
@option("--days", type=click.FloatRange(min=0, min_open=True), default=365, show_default=True)
@option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Certificate file.")
def admit_command(
    directory: Path, identity: Path | None, peer_id: str | None, role: str, days: float, out: Path
) -> None:
    """Issue a membership certificate for a peer identity."""
    from petals.membership import Certificate, Identity, load_authority_key

    exclusive(("--identity", identity is not None), ("--peer_id", peer_id is not None))
    if identity is None and peer_id is None:
        raise click.UsageError("name the peer: --identity KEY_FILE or --peer_id ID")
    authority_key = load_authority_key(directory)
    if identity is not None:
        if not identity.exists():
            click.echo(f"Created a new identity: {identity}")
        peer = Identity.load_or_create(identity).peer_id
    else:
        peer = parse_peer_id(peer_id)
    certificate = Certificate.issue(authority_key, peer, role, days)
    out.write_bytes(certificate.raw)
    click.echo(f"Admitted {certificate.describe()}: {out}")
    key = identity or "KEY"
    click.echo(
        f"Start it with --swarm_authority {directory / 'authority.pub'} --membership {out} --identity_path {key}"
    )


def parse_peer_id(text: str):
    """An RSA libp2p peer id (``Qm...``), as hivemind's identities have, or a usage error."""
    from hivemind.p2p import PeerID

    try:
        peer = PeerID.from_base58(text)
    except ValueError:
        peer = None
    if peer is None or not peer.to_bytes().startswith(b"\x12\x20") or len(peer.to_bytes()) != 34:
        raise click.BadParameter(f"{text!r} is not an RSA libp2p peer id (Qm...)", param_hint="--peer_id")
    return peer


@swarm_command.command("revoke", cls=PetalsCommand)
@DIRECTORY
@click.argument("certificate", type=click.Path(dir_okay=False, exists=True, path_type=Path))
def revoke_command(directory: Path, certificate: Path) -> None:
    """Revoke a certificate: add it to DIRECTORY/revocations.json, the list `petals dht --revocations` publishes."""
    from petals.membership import (
        REVOCATIONS_FILE,
        Certificate,
        RevocationList,
        SwarmMembership,
        load_authority_key,
    )

    authority_key = load_authority_key(directory)
    membership = SwarmMembership(authority_key.public_key())
    revoked = membership.verified(Certificate.read(certificate).raw)  # this authority's, expired or not
    path = directory / REVOCATIONS_FILE
    current = (
        membership.verified_revocations(path.read_bytes())
        if path.exists()
        else RevocationList.empty(authority_key)
    )
    updated = current.revoking(authority_key, revoked)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(updated.raw)
    temporary.replace(path)  # a `petals dht` rereading it never sees half a file
    click.echo(f"Revoked {revoked.describe()}: {path} is now version {updated.version}.")
    click.echo(
        f"Peers learn it within an update period once a `petals dht --swarm_authority {directory / 'authority.pub'} "
        f"--revocations {path}` publishes it."
    )
