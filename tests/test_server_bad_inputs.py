"""Every malformed request fails alone with a clear message; the server keeps serving and its KV-cache
budget returns exactly to where it started."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

import petals
from petals.data_structures import make_uids
from petals.testing.swarm import InProcessDht, InProcessServer
from petals.testing.wire_client import WireClient, make_request
from petals.wire import serialize_tensor

PREFIX = "tiny-llama-hf"
UIDS = make_uids(PREFIX, 0, 4)
LIMITS = (
    "--inference_max_length",
    "32",
    "--max_batch_size",
    "64",
    "--attn_cache_tokens",
    "64",
    "--step_timeout",
    "3",
)


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    with InProcessDht().start() as dht:
        with InProcessServer(
            tiny_model_path("llama"),
            dht.initial_peers,
            "--block_indices",
            "0:4",
            "--throughput",
            "1",
            *LIMITS,
        ).start() as server:
            client = WireClient(dht.initial_peers)
            client.server = server.peer_id
            client.initial_peers = dht.initial_peers
            client.initial_tokens = client.info(server.peer_id)["cache_tokens_available"]
            yield client
            client.close()


@pytest.fixture
def client(swarm):
    """The shared client; after each test the server must still serve and hold no cache."""
    yield swarm
    assert swarm.forward(swarm.server, UIDS, torch.randn(1, 3, 64)).shape == (1, 3, 64)
    assert cache_tokens(swarm) == swarm.initial_tokens


def cache_tokens(client: WireClient, wait: float = 5) -> int:
    deadline = time.monotonic() + wait
    while (tokens := client.info(client.server)["cache_tokens_available"]) != client.initial_tokens:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return tokens


def refused(match: str):
    return pytest.raises(P2PHandlerError, match=match)


def raw_forward(client: WireClient, tensors=None, metadata: bytes | None = None, uid: str = " ".join(UIDS)):
    request = make_request(UIDS, [torch.randn(1, 2, 64), torch.empty(0)], {})
    request = runtime_pb2.ExpertRequest(
        uid=uid,
        tensors=tensors if tensors is not None else request.tensors,
        metadata=metadata if metadata is not None else request.metadata,
    )
    return client.call(client.server, "rpc_forward", request)


@pytest.mark.parametrize(
    ("hidden", "message"),
    [
        (torch.randn(1, 3, 32), "hidden size is 32, this model's is 64"),
        (torch.ones(1, 3, 64, dtype=torch.int64), "must be a floating-point tensor"),
        (torch.randn(3, 64), re.escape("must have shape [batch, length, hidden]")),
        (torch.randn(1, 0, 64), "hidden states are empty"),
        (torch.randn(2, 40, 64), "more than this server's --max_batch_size 64"),
    ],
)
def test_forward_rejects_bad_hidden_states(client, hidden, message):
    with refused(message):
        client.forward(client.server, UIDS, hidden)


def test_unknown_uid_and_prefix(client):
    with refused(
        "does not serve tiny-llama-hf.8, tiny-llama-hf.9; it serves tiny-llama-hf.0 to tiny-llama-hf.3"
    ):
        client.forward(client.server, make_uids(PREFIX, 8, 10), torch.randn(1, 2, 64))
    with refused("does not serve other-model.0"):
        client.forward(client.server, ["other-model.0"], torch.randn(1, 2, 64))
    with refused("names no block uids"):
        raw_forward(client, uid="")


def test_unknown_adapter(client):
    request = make_request(UIDS, [torch.randn(1, 2, 64), torch.empty(0)], {"active_adapter": "my-lora"})
    with refused("unknown adapter 'my-lora'; this server has: none"):
        client.call(client.server, "rpc_forward", request)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (MSGPackSerializer.dumps([1, 2, 3]), "metadata must be a dict"),
        (MSGPackSerializer.dumps({"points": "many"}), "field 'points' has an invalid value"),
        (MSGPackSerializer.dumps({"args_structure": "nonsense"}), "args_structure must be"),
        (
            MSGPackSerializer.dumps({"args_structure": ((b"__T7",), {})}),
            "names tensor 7 but only 2 were sent",
        ),
        (b"\xc1\xff garbage", "not valid MessagePack"),
    ],
)
def test_malformed_metadata(client, metadata, message):
    with refused(message):
        raw_forward(client, metadata=metadata)


def test_garbage_tensor_bytes(client):
    good = serialize_tensor(torch.randn(1, 2, 64))
    short = runtime_pb2.Tensor(buffer=good.buffer[:100], size=good.size, dtype="float32")
    with refused("needs 512 bytes, got 100"):
        raw_forward(client, tensors=[short])
    with refused("unsupported tensor dtype 'object'"):
        raw_forward(client, tensors=[runtime_pb2.Tensor(buffer=b"\x00" * 8, size=[1], dtype="object")])


def test_oversize_max_length(client):
    with refused("max_length 33 exceeds this server's --inference_max_length 32"):
        client.inference(client.server, UIDS, max_length=33).step(torch.randn(1, 1, 64))


def test_session_longer_than_budget(client):
    with refused("whole budget"):
        client.inference(client.server, UIDS, max_length=32).step(torch.randn(4, 1, 64))  # 4 × 32 tokens > 64


def test_first_request_without_max_length(client):
    with refused("must carry metadata max_length"):
        stream = client.inference(client.server, UIDS, max_length=4)
        stream.send(
            make_request(UIDS, [torch.randn(1, 1, 64), torch.empty(0), torch.empty(0, dtype=torch.int64)], {})
        )


def test_exceeding_session_length(client):
    stream = client.inference(client.server, UIDS, max_length=4)
    stream.step(torch.randn(1, 3, 64))
    with refused("Maximum length exceeded: 3 tokens so far \\+ 2 new > max_length 4"):
        stream.step(torch.randn(1, 2, 64))


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ({"hidden": torch.randn(2, 1, 64)}, "this session has batch size 1"),
        (
            {"hidden": torch.randn(1, 1, 64), "hypo_ids": torch.tensor([3])},
            re.escape("hypo_ids must be in [0, 1)"),
        ),
        (
            {"hidden": torch.randn(1, 1, 64), "start_from_position": 9},
            "start_from_position 9 is beyond the 2 tokens",
        ),
        (
            {"hidden": torch.randn(1, 1, 64), "start_from_position": -1},
            "'start_from_position' has an invalid value: -1",
        ),
        (
            {"hidden": torch.randn(1, 1, 64), "start_from_position": "1"},
            "'start_from_position' has an invalid value: '1'",
        ),
        ({"hidden": torch.randn(1, 1, 64), "prompts": torch.randn(4, 1, 5, 64)}, "cover 5 positions"),
    ],
)
def test_bad_inference_step(client, step, message):
    stream = client.inference(client.server, UIDS, max_length=8)
    stream.step(torch.randn(1, 2, 64))
    with refused(message):
        stream.step(**step)


def test_bad_keep_or_resume_fails_alone(client):
    with refused("resume position must be an integer from 0 to max_length 8"):
        resuming = client.inference(client.server, UIDS, max_length=8, resume={"key": "k", "position": 9})
        resuming.step(torch.randn(1, 1, 64))
    stream = client.inference(client.server, UIDS, max_length=8)
    stream.step(torch.randn(1, 2, 64))
    with refused("field 'keep' has an invalid value: 7"):
        stream.step(torch.randn(1, 1, 64), keep=7)
    stream = client.inference(client.server, UIDS, max_length=8)
    stream.step(torch.randn(1, 2, 64))
    with refused("keep must be a string of 1 to 256 characters"):
        stream.step(torch.randn(1, 1, 64), keep="")


def test_step_timeout_frees_the_session(client):
    stream = client.inference(client.server, UIDS, max_length=8)
    stream.step(torch.randn(1, 2, 64))
    assert client.info(client.server)["cache_tokens_available"] < client.initial_tokens
    time.sleep(3.5)
    with pytest.raises(P2PHandlerError, match="no inference step within --step_timeout 3"):
        stream.step(torch.randn(1, 1, 64))


def test_client_vanishing_mid_session(client):
    vanishing = WireClient(client.initial_peers)
    stream = vanishing.inference(client.server, UIDS, max_length=8)
    stream.step(torch.randn(1, 2, 64))
    assert client.info(client.server)["cache_tokens_available"] < client.initial_tokens
    vanishing.close()  # its daemon goes away with the stream open


def test_rewind_and_beam_reorder_keep_serving(client):
    stream = client.inference(client.server, UIDS, max_length=8)
    first = stream.step(torch.randn(2, 3, 64))
    again = stream.step(torch.randn(2, 1, 64), start_from_position=2, hypo_ids=torch.tensor([1, 0]))
    assert first.shape == (2, 3, 64) and again.shape == (2, 1, 64)
    stream.close()


def test_rollback_recomputes_exactly(client):
    """After ``start_from_position`` the cache holds only the kept positions: as if the rest never came."""
    tokens, junk = torch.randn(1, 5, 64), torch.randn(1, 2, 64)
    straight = client.inference(client.server, UIDS, max_length=8)
    expected = straight.step(tokens)
    straight.close()
    rolled_back = client.inference(client.server, UIDS, max_length=8)
    rolled_back.step(tokens[:, :3])
    rolled_back.step(junk)
    again = rolled_back.step(tokens[:, 3:], start_from_position=3)
    rolled_back.close()
    assert torch.allclose(again, expected[:, 3:], atol=1e-5), (again - expected[:, 3:]).abs().max()


def test_nothing_is_unpickled():
    sources = Path(petals.__file__).parent.rglob("*.py")
    offenders = [
        str(p)
        for p in sources
        if re.search(r"\bimport pickle\b|pickle\.loads?\(|torch\.load\(", p.read_text())
    ]
    assert offenders == []
