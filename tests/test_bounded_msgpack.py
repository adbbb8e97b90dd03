"""MessagePack from the network is decoded with bounded nesting: ~950 bytes of nested tuples, sent to
any RPC or stored in the DHT under a block's key, are refused with a clear error instead of
overflowing the C stack of every process that decodes them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgpack
import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2PHandlerError, PeerID
from hivemind.proto import dht_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT
from petals.bounded_msgpack import MAX_DEPTH, MsgpackLimitError, check_msgpack
from petals.data_structures import ServerInfo, ServerState, make_uids
from petals.testing.malformed import nested_metadata, nested_tuples
from petals.testing.swarm import running_swarm
from petals.testing.wire_client import WireClient, make_request

PREFIX = "tiny-llama-hf"
UIDS = make_uids(PREFIX, 0, 4)


def decode_in_subprocess(bounded: bool) -> subprocess.CompletedProcess:
    script = f"""
        from hivemind.utils.serializer import MSGPackSerializer
        from petals.patches import BOUNDED_MSGPACK, apply_patches
        from petals.testing.malformed import nested_tuples
        if {bounded}:
            apply_patches([BOUNDED_MSGPACK])
        try:
            MSGPackSerializer.loads(nested_tuples(200))
        except ValueError as error:
            print("refused:", error)
    """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )


def test_unbounded_decoder_crashes_and_bounded_one_refuses():
    assert decode_in_subprocess(bounded=False).returncode == -11  # SIGSEGV: what we guard against
    bounded = decode_in_subprocess(bounded=True)
    assert bounded.returncode == 0, bounded.stderr
    assert f"refused: MessagePack nested deeper than {MAX_DEPTH} levels" in bounded.stdout


@pytest.mark.parametrize(
    "value",
    [
        {"session_id": "s", "max_length": 128, "args_structure": ((b"__T0", b"__T1"), {})},
        {"next_servers": [("QmPeer", "session", 0, 4)], "pushed": True, "points": 1.5},
        ServerInfo(ServerState.ONLINE, 12.5, adapters=("a", "b")).to_tuple(),
        [None, True, False, -1, 2**63 - 1, -(2**63), 1e300, "x" * 70_000, b"y" * 70_000],
        {str(index): index for index in range(70_000)},
    ],
)
def test_everything_petals_sends_is_accepted(value):
    check_msgpack(MSGPackSerializer.dumps(value))


@pytest.mark.parametrize(
    "raw, reason",
    [
        (nested_tuples(200), "nested deeper"),
        (b"\x91" * 40 + b"\xc0", "nested deeper"),  # plain lists count too
        (b"\xdd\xff\xff\xff\xff", "claims 4294967295 items"),
        (b"\xc6\xff\xff\xff\xff", "truncated"),
        (b"\xc1", "invalid MessagePack byte"),
        (b"\x01\x02", "stray bytes"),
        (msgpack.packb(msgpack.ExtType(0x40, b"\x01\x02")), "stray bytes"),  # inside a tuple's payload
    ],
)
def test_malformed_msgpack_is_refused(raw, reason):
    with pytest.raises(MsgpackLimitError, match=reason):
        check_msgpack(raw)


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    path = tiny_model_path("llama")
    # records refused are one DEBUG line each (a WARNING per record let anyone fill a server's log)
    with running_swarm(path, "0:4", server_args=("--log_level", "DEBUG")) as (dht, servers):
        client = WireClient(dht.initial_peers)
        yield path, dht, servers[0], client
        client.close()


def nested_request(uid: str = " ".join(UIDS)) -> runtime_pb2.ExpertRequest:
    request = make_request(UIDS, [torch.randn(1, 2, 64), torch.empty(0)], {})
    return runtime_pb2.ExpertRequest(uid=uid, tensors=request.tensors, metadata=nested_metadata())


@pytest.mark.parametrize("method", ["rpc_forward", "rpc_backward", "rpc_push"])
def test_nested_metadata_is_refused_by_unary_rpcs(swarm, method):
    _, _, server, client = swarm
    with pytest.raises(P2PHandlerError, match="nested deeper"):
        client.call(server.peer_id, method, nested_request())
    assert server.process.poll() is None


@pytest.mark.parametrize("method", ["rpc_forward_stream", "rpc_backward_stream", "rpc_inference"])
def test_nested_metadata_is_refused_by_streams(swarm, method):
    _, _, server, client = swarm
    with pytest.raises(P2PHandlerError, match="nested deeper"):
        client.call_stream(server.peer_id, method, [nested_request()])
    assert server.process.poll() is None


def test_nested_metadata_in_a_later_inference_step_is_refused(swarm):
    _, _, server, client = swarm
    stream = client.inference(server.peer_id, UIDS, max_length=16)
    stream.step(torch.randn(1, 3, 64))
    with pytest.raises(P2PHandlerError, match="nested deeper"):
        stream.send(nested_request())
    assert server.process.poll() is None


def test_nested_dht_records_are_refused_and_generation_still_matches(swarm):
    path, dht, server, client = swarm
    key = DHTID.generate(source=UIDS[0])
    expiration = get_dht_time() + 60
    honest_subkey = MSGPackSerializer.dumps(PeerID(b"\x00" * 34).to_base58())
    honest_value = MSGPackSerializer.dumps(ServerInfo(ServerState.ONLINE, 1.0).to_tuple())
    # raw bytes on the wire: hivemind's own call_store would serialize the subkey once more
    request = dht_pb2.StoreRequest(
        keys=[key.to_bytes()] * 2,
        subkeys=[honest_subkey, nested_tuples(200)],
        values=[nested_tuples(200), honest_value],
        expiration_time=[expiration] * 2,
        in_cache=[False] * 2,
        peer=client.node.protocol.node_info,
    )
    for peer in (server.peer_id, client_peer(dht)):
        response = client.run(client.node.protocol.get_stub(PeerID.from_base58(peer)).rpc_store(request))
        assert list(response.store_ok) == [False, False]
    server.wait_for_log("Ignoring a DHT record: its value is refused")
    server.wait_for_log("Ignoring a DHT record: its subkey is refused")
    assert server.process.poll() is None and dht.process.poll() is None

    remote = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
    )
    try:
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(0))
        kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert torch.equal(remote.generate(ids, **kwargs), local.generate(ids, **kwargs))
    finally:
        remote.remote_blocks.network.close()


def client_peer(dht) -> str:
    """The bootstrap peer's id, from the multiaddr it printed."""
    return dht.initial_peers[0].rsplit("/p2p/", 1)[1]
