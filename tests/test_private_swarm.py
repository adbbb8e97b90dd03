"""Private swarms (``petals.membership``): members generate as before; outsiders cannot announce, be
routed to, be served or overwrite; revoked and expired certificates stop working within an update
period. One private swarm (a ``petals dht`` and a ``petals serve``) is shared by the module."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hivemind.p2p import P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT
from petals.cli import main as petals_cli
from petals.client.routing import MissingBlocksError
from petals.data_structures import ServerInfo, ServerState, make_uids
from petals.dht import declare_active_modules, expiration_from_now, get_remote_module_infos
from petals.membership import CERTIFICATE_PROTOCOL
from petals.testing.swarm import InProcessServer, start_dht, start_server
from petals.testing.wire_client import WireClient, make_request

PERIOD = 1.0  # every peer's update period: revocations arrive within about one
PREFIX = "tiny-llama-hf"
UIDS = make_uids(PREFIX, 0, 4)
HIDDEN = 64
PEERS = {
    "server": "server",
    "alice": "client",
    "carol": "client",
    "member": "server",
    "revoked": "client",
    "rogue": "server",
}
GREEDY = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def swarm_cli(*args: object) -> str:
    result = CliRunner().invoke(petals_cli, ["swarm", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


@dataclass
class PrivateSwarm:
    model_path: Path
    authority: Path
    initial_peers: list[str]
    dht: object
    server: object

    def credentials(self, name: str, authority: Path | None = None) -> dict[str, str]:
        authority = authority or self.authority
        return {
            "swarm_authority": str(authority / "authority.pub"),
            "membership": str(authority / f"{name}.cert"),
            "identity_path": str(authority / f"{name}.key"),
        }

    def peer(self, name: str | None = None, authority: Path | None = None) -> WireClient:
        """An in-process peer: a member ``name`` (of ``authority``), or an outsider (no name)."""
        return WireClient(self.initial_peers, **(self.credentials(name, authority) if name else {}))


def cli_credentials(credentials: dict[str, str]) -> list[str]:
    return [word for name, value in credentials.items() for word in (f"--{name}", value)]


@pytest.fixture(scope="module")
def swarm(tiny_model_path, tmp_path_factory):
    path = tiny_model_path("llama")
    authority = tmp_path_factory.mktemp("authority")
    swarm_cli("init", authority)
    for name, role in PEERS.items():
        swarm_cli(
            "admit",
            authority,
            "--identity",
            authority / f"{name}.key",
            "--role",
            role,
            "--out",
            authority / f"{name}.cert",
        )
    private = ["--swarm_authority", str(authority / "authority.pub"), "--update_period", str(PERIOD)]
    with start_dht(*private, "--revocations", str(authority / "revocations.json")) as dht:
        swarm = PrivateSwarm(path, authority, dht.initial_peers, dht, None)
        server_args = [*private, *cli_credentials(swarm.credentials("server")), "--torch_dtype", "float32"]
        # records outlive a few late announcements of a loaded machine (the default: 2 update periods)
        server_args += ["--throughput", "1", "--expiration", "30"]
        with start_server(path, dht.initial_peers, *server_args) as swarm.server:
            yield swarm


@pytest.fixture(scope="module")
def alice(swarm):
    """A member client, as ``from_pretrained`` makes one."""
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path,
        initial_peers=swarm.initial_peers,
        update_period=PERIOD,
        **swarm.credentials("alice"),
        **LOOPBACK_CLIENT,
    )
    yield model
    model.close()


def announced_info(throughput: float = 1e6) -> ServerInfo:
    """What a server says about itself, made attractive: every block, fast, plenty of cache."""
    return ServerInfo(
        ServerState.ONLINE, throughput, start_block=0, end_block=4, inference_rps=1e6, cache_tokens_left=10**9
    )


def announced(model) -> set[str]:
    """The servers of the model's blocks that the DHT returns to ``model``'s client."""
    network = model.remote_blocks.network
    infos = network.run(get_remote_module_infos(network.node, UIDS, latest=True))
    return {str(peer) for info in infos for peer in info.servers}


def usable_servers(model) -> set[str]:
    manager = model.remote_blocks.manager
    manager.network.run(manager.update())
    return {str(span.peer_id) for span in manager.usable_spans()}


def test_members_generate_as_transformers_does(swarm, alice):
    ids = torch.tensor([[5, 17, 42, 7]])
    local = AutoModelForCausalLM.from_pretrained(swarm.model_path, dtype=torch.float32).eval()
    assert torch.equal(alice.generate(ids, **GREEDY), local.generate(ids, **GREEDY))
    assert swarm.server.peer_id in usable_servers(alice)


def test_petals_health_sees_the_private_swarm_with_a_membership(swarm):
    health = ["health", "--loopback", "--initial_peers", *swarm.initial_peers]
    result = CliRunner().invoke(petals_cli, [*health, *cli_credentials(swarm.credentials("carol"))])
    assert result.exit_code == 0, result.output
    assert f"(dht_prefix {PREFIX}, 4 blocks): healthy" in result.output and "ONLINE" in result.output


def test_an_outsider_is_refused_before_anything_it_sent_is_decoded(swarm):
    outsider, member = swarm.peer(), swarm.peer("member")
    undecodable = make_request(UIDS[:1], [torch.randn(1, 1, HIDDEN)], {})
    undecodable.tensors[0].dtype = "object"  # decoding it would fail with [bad_request]
    try:
        with pytest.raises(P2PHandlerError, match=r"\[bad_request\]"):
            member.call(swarm.server.peer_id, "rpc_forward", undecodable)
        with pytest.raises(P2PHandlerError, match=r"\[unauthorized\] .*presented no membership certificate"):
            outsider.info(swarm.server.peer_id)
        with pytest.raises(P2PHandlerError, match=r"\[unauthorized\]"):
            outsider.call(swarm.server.peer_id, "rpc_forward", undecodable)
        with pytest.raises(P2PHandlerError, match=r"\[unauthorized\]"):
            outsider.inference(swarm.server.peer_id, UIDS, max_length=8).step(torch.randn(1, 1, HIDDEN))
        assert swarm.server.wait_for_log(f"rpc_info from {outsider.p2p.peer_id.to_base58()[-6:]} refused")
    finally:
        outsider.close()
        member.close()


def test_a_stolen_certificate_does_not_admit_its_thief(swarm):
    thief = swarm.peer()
    stolen = (swarm.authority / "server.cert").read_bytes()

    async def present(request, context) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=stolen)

    try:
        thief.run(thief.p2p.add_protobuf_handler(CERTIFICATE_PROTOCOL, present, runtime_pb2.ExpertUID))
        with pytest.raises(
            P2PHandlerError, match=rf"\[unauthorized\] .*names peer {swarm.server.peer_id}, not"
        ):
            thief.info(swarm.server.peer_id)
    finally:
        thief.close()


def test_only_servers_push_to_servers(swarm):
    client = swarm.peer("revoked")  # a client certificate (revoked only in a later test)
    try:
        assert client.info(swarm.server.peer_id)["version"] == petals.__version__
        with pytest.raises(P2PHandlerError, match=r"\[unauthorized\] rpc_push is for servers"):
            client.call(
                swarm.server.peer_id, "rpc_push", make_request(UIDS[:1], [torch.randn(1, 1, HIDDEN)], {})
            )
    finally:
        client.close()


def test_outsiders_cannot_announce_and_are_not_routed_to(swarm, alice, tmp_path):
    """Neither a peer without a certificate nor a member of another private swarm."""
    swarm_cli("init", tmp_path)
    swarm_cli("admit", tmp_path, "--identity", tmp_path / "stranger.key", "--out", tmp_path / "stranger.cert")
    outsiders = [swarm.peer(), swarm.peer("stranger", tmp_path)]
    try:
        for outsider in outsiders:
            stored = outsider.run(
                declare_active_modules(outsider.node, UIDS, announced_info(), expiration_from_now(30))
            )
            assert not any(stored.values()), stored
        stranger = outsiders[1].p2p.peer_id.to_base58()
        assert "was issued by authority" in swarm.dht.wait_for_log(
            f"Refused a DHT record of a private swarm (subkey '{stranger}')"
        )
        assert announced(alice) == {swarm.server.peer_id}
        assert usable_servers(alice) == {swarm.server.peer_id}
    finally:
        for outsider in outsiders:
            outsider.close()


def test_a_member_cannot_overwrite_another_members_records(swarm):
    member = swarm.peer("member")
    try:
        forged = [announced_info(throughput=1e6).to_tuple()] * len(UIDS)
        stored = member.run(
            member.node.store_many(
                UIDS, forged, expiration_from_now(30), subkeys=[swarm.server.peer_id] * len(UIDS)
            )
        )
        assert not any(stored.values()), stored
        own = member.run(
            declare_active_modules(member.node, UIDS[:1], announced_info(), expiration_from_now(5))
        )
        assert all(own.values())  # a member writes its own records
        (info,) = member.module_infos(UIDS[:1])
        assert info.servers[PeerID.from_base58(swarm.server.peer_id)].throughput == 1.0  # --throughput 1
        assert info.servers[member.p2p.peer_id].throughput == 1e6
    finally:
        member.close()


def test_revoked_and_expired_certificates_stop_working_within_an_update_period(swarm, alice):
    revoked, rogue = swarm.peer("revoked"), swarm.peer("rogue")
    swarm_cli(
        "admit",
        swarm.authority,
        "--identity",
        swarm.authority / "brief.key",
        "--role",
        "client",
        "--days",
        6 / 86400,
        "--out",
        swarm.authority / "brief.cert",
    )
    brief = swarm.peer("brief")
    server = swarm.server.peer_id
    try:
        stream = revoked.inference(server, UIDS, max_length=8)
        assert stream.step(torch.randn(1, 1, HIDDEN)).shape == (1, 1, HIDDEN)
        assert brief.info(server)["version"] == petals.__version__
        rogue.run(declare_active_modules(rogue.node, UIDS, announced_info(), expiration_from_now(60)))
        rogue_id = rogue.p2p.peer_id
        assert _eligible_after_update(alice, rogue_id)

        swarm_cli("revoke", swarm.authority, swarm.authority / "revoked.cert")
        swarm_cli("revoke", swarm.authority, swarm.authority / "rogue.cert")
        # the DHT peer rereads the file, then the server fetches the list: a period each (1 s here);
        # the bound is generous, for a loaded machine
        assert "was revoked" in _refused(revoked, server, timeout=15)
        with pytest.raises((StopAsyncIteration, ConnectionError)):  # the stream opened before was ended
            stream.step(torch.randn(1, 1, HIDDEN))
        assert not _eligible_after_update(alice, rogue_id)
        assert swarm.dht.wait_for_log("DHT records of revoked certificates")

        assert "expired at" in _refused(brief, server, timeout=20)
    finally:
        for peer in (revoked, rogue, brief):
            peer.close()


def _eligible_after_update(model, peer: PeerID) -> bool:
    manager = model.remote_blocks.manager
    manager.network.run(manager.update())
    return peer in manager.online_spans


def _refused(client: WireClient, server: str, timeout: float) -> str:
    """Call ``rpc_info`` until the server refuses it; the refusal's text."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.info(server)
        except P2PHandlerError as error:
            assert "[unauthorized]" in str(error), error
            return str(error)
        time.sleep(0.2)
    raise AssertionError(f"the server still served {client.p2p.peer_id} after {timeout} s")


def test_an_open_session_routes_around_a_server_revoked_after_it_chose_it(swarm):
    """A revoked server keeps serving if it wants to; the client must stop sending it hidden states: its
    open session's next steps after the client's next update go to another server, replaying the history."""
    names = ("second", "third")
    for name in names:
        swarm_cli(
            "admit", swarm.authority, "--identity", swarm.authority / f"{name}.key", "--role", "server",
            "--out", swarm.authority / f"{name}.cert",
        )  # fmt: skip
    private = ["--swarm_authority", str(swarm.authority / "authority.pub"), "--update_period", str(PERIOD)]
    args = [*private, "--torch_dtype", "float32", "--throughput", "1", "--expiration", "30"]
    with contextlib.ExitStack() as stack:
        servers = {  # in this process: they only need to serve, and they load together
            name: stack.enter_context(
                InProcessServer(
                    swarm.model_path, swarm.initial_peers, *args, *cli_credentials(swarm.credentials(name))
                ).start(wait=False)
            )
            for name in names
        }
        for server in servers.values():
            server.wait_ready()
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            swarm.model_path,
            initial_peers=swarm.initial_peers,
            update_period=PERIOD,
            blocked_servers=[swarm.server.peer_id],  # the route is on one of the two new servers
            **swarm.credentials("carol"),
            **LOOPBACK_CLIENT,
        )
        stack.callback(model.close)
        hidden = torch.randn(1, 200, HIDDEN, generator=torch.Generator().manual_seed(2))
        with model.inference_session(max_length=hidden.shape[1]) as session:
            outputs = [session.step(hidden[:, :4])]
            (chosen,) = {str(span.peer_id) for span in session.route}
            revoked = next(name for name, server in servers.items() if server.peer_id == chosen)
            swarm_cli("revoke", swarm.authority, swarm.authority / f"{revoked}.cert")
            position, deadline = 4, time.monotonic() + 30  # the DHT peer, then the client: a period each
            while chosen in {str(span.peer_id) for span in session.route} and time.monotonic() < deadline:
                outputs.append(session.step(hidden[:, position : position + 1]))
                position += 1
                time.sleep(0.1)
            assert chosen not in {str(span.peer_id) for span in session.route}, (
                "still routed to the revoked server"
            )
            steps = servers[revoked].server.span.engine.events
            served = steps["inference_steps"]
            outputs.append(session.step(hidden[:, position : position + 1]))  # on the replacement
            position += 1
            assert steps["inference_steps"] == served  # it still serves, but gets no more of this session
        with torch.no_grad():
            expected = model.remote_blocks(hidden[:, :position])  # a forward, on the server left
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=1e-5, rtol=0)


def test_an_outsider_is_told_in_one_line_that_the_swarm_is_private(swarm, caplog):
    """A client without the swarm's options: one WARNING line naming them, no warning per record it cannot
    read, and a failure that says the same instead of "no server announces it"."""
    caplog.set_level(logging.DEBUG)
    outsider = petals.AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.initial_peers, max_retries=0, loopback=True
    )
    try:
        with pytest.raises(MissingBlocksError, match="this swarm is private") as caught:
            outsider(torch.tensor([[1, 2, 3]]))
    finally:
        outsider.close()
    for option in ("--swarm_authority", "--membership", "--identity_path"):
        assert option in str(caught.value)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    private = [message for message in warnings if "this swarm is private" in message]
    assert len(private) == 1 and "--swarm_authority" in private[0], warnings
    assert warnings == private  # nothing per record it cannot read: those are DEBUG lines


def test_petals_generate_without_the_options_says_which_to_pass(swarm, tiny_model_with_tokenizer):
    result = subprocess.run(
        [sys.executable, "-m", "petals.cli", "generate", str(swarm.model_path), "hi", "--loopback"]
        + ["--tokenizer", str(tiny_model_with_tokenizer), "--initial_peers", swarm.initial_peers[0]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PETALS_MAX_RETRIES": "0"},
    )
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: no server for block") and "this swarm is private" in last, result.stderr
    assert "--swarm_authority AUTHORITY.pub --membership CERT --identity_path KEY" in last
    assert "Ignoring a DHT record" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_server_without_the_options_is_told_too(swarm):
    with start_server(
        swarm.model_path, swarm.initial_peers, "--torch_dtype", "float32", wait_ready=False
    ) as server:
        line = server.wait_for_log("this swarm is private", timeout=180)
    assert " WARN " in line and "--swarm_authority" in line
    assert "Ignoring a DHT record:" not in server.log
