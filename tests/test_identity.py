"""``--identity_path`` of a swarm member: a peer id already online is refused before this peer starts,
and the check that finds out sends nothing this peer's own options would not."""

from __future__ import annotations

import asyncio
import re

import pytest
from hivemind.p2p import P2P

from petals.cli.errors import explain
from petals.network.p2p import IdentityInUseError, NetworkOptions
from petals.testing.swarm import LOOPBACK_CLIENT, InProcessDht


def loopback(initial_peers: list[str], identity_path: str | None) -> NetworkOptions:
    return NetworkOptions(initial_peers=initial_peers, identity_path=identity_path, **LOOPBACK_CLIENT)


# the check finds a peer through the bootstrap, which learns of a new peer shortly after it connects
# (libp2p's identify exchange): on a loaded machine, a check right after the first start may miss it
REFUSED_WITHIN_SECONDS = 30


class LetThrough(Exception):
    """A start that the identity check let through, stopped before its p2pd started."""


async def start_refused_within(seconds: float, options: NetworkOptions) -> IdentityInUseError:
    """Start a peer with ``options`` until its identity check refuses the start. A start that the check
    lets through stops before its p2pd starts (``LetThrough``): a peer with the identity that got
    through would take over the id at the bootstrap and, once gone, leave it pointing at its closed
    addresses, so that the first peer is not found again for minutes. The check's own probe starts for
    real (it has no identity file)."""
    create = P2P.create

    async def create_without_identity(*args, **kwargs) -> P2P:
        if kwargs.get("identity_path") is not None:
            raise LetThrough
        return await create(*args, **kwargs)

    deadline = asyncio.get_running_loop().time() + seconds
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(P2P, "create", create_without_identity)
        while True:
            try:
                await options.create_p2p()
            except IdentityInUseError as refusal:
                return refusal
            except LetThrough:
                pass
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"a peer with the identity of an online one was not refused within {seconds} s")
            await asyncio.sleep(0.5)


def test_an_identity_online_already_is_refused_in_one_line_and_free_again_once_its_peer_left(tmp_path):
    key = str(tmp_path / "server.key")
    P2P.generate_identity(key)

    async def scenario(initial_peers: list[str]) -> None:
        first = await loopback(initial_peers, key).create_p2p()
        try:
            refusal = await start_refused_within(REFUSED_WITHIN_SECONDS, loopback(initial_peers, key))
        finally:
            await first.shutdown()
        message = explain(refusal)
        assert message == str(refusal) and "\n" not in message
        assert f"--identity_path {key} is in use: peer {first.peer_id}" in message
        again = await loopback(initial_peers, key).create_p2p()  # its peer left: the identity is free
        assert again.peer_id == first.peer_id
        await again.shutdown()

    with InProcessDht().start() as dht:
        asyncio.run(scenario(dht.initial_peers))


def test_the_identity_check_starts_no_p2p_daemon_with_nat_traversal_this_peer_turned_off(
    tmp_path, monkeypatch
):
    """hivemind's own check started its probe with UPnP/NAT-PMP and AutoNAT on, --loopback or not."""
    key = str(tmp_path / "server.key")
    P2P.generate_identity(key)
    daemons: list[list[str]] = []
    start = asyncio.subprocess.create_subprocess_exec

    async def recording(program, *args, **kwargs):
        if str(program).endswith("p2pd"):
            daemons.append([str(arg) for arg in args])
        return await start(program, *args, **kwargs)

    async def create(options: NetworkOptions) -> None:
        await (await options.create_p2p()).shutdown()

    with InProcessDht().start() as dht:
        monkeypatch.setattr(asyncio.subprocess, "create_subprocess_exec", recording)
        asyncio.run(create(loopback(dht.initial_peers, key)))
        assert len(daemons) == 2  # the check's probe, then the peer
        probe, peer = daemons
        for flags in daemons:
            assert {"-natPortMap=0", "-autonat=0"} <= set(flags)
            assert not any(re.match(r"-(relay|autoRelay)\w*=1", flag) for flag in flags)
        assert "-noListenAddrs=1" in probe and "-noListenAddrs=1" not in peer
        assert not any(flag.startswith("-id=") for flag in probe)  # the probe has an identity of its own

        daemons.clear()  # a new identity file (created now), or no swarm to ask: nothing to check
        asyncio.run(create(loopback(dht.initial_peers, str(tmp_path / "new.key"))))
        asyncio.run(create(loopback([], key)))
        assert len(daemons) == 2
