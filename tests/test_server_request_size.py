"""Oversized streams are refused before they are read, memory returns to its baseline, and refusals
are logged in one short line (no tracebacks, peers' strings cut)."""

from __future__ import annotations

import time
import uuid

import psutil
import pytest
import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from petals.data_structures import make_uids
from petals.server.validation import max_request_bytes
from petals.testing.swarm import InProcessDht, start_server
from petals.testing.wire_client import WireClient, make_request
from petals.wire import request_parts, write_metadata

UIDS = make_uids("tiny-llama-hf", 0, 4)
MAX_BATCH_SIZE = 64
HUGE_TOKENS = 400_000  # x 64 hidden x 4 bytes: a 102 MB request


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    with InProcessDht().start() as dht:
        with start_server(
            tiny_model_path("llama"),
            dht.initial_peers,
            "--block_indices",
            "0:4",
            "--throughput",
            "1",
            "--max_batch_size",
            str(MAX_BATCH_SIZE),
        ) as server:
            client = WireClient(dht.initial_peers)
            yield server, client
            client.close()


def rss(server) -> int:
    return psutil.Process(server.pid).memory_info().rss


def settled_rss(server, baseline: int, tolerance: int, wait: float = 5) -> int:
    deadline = time.monotonic() + wait
    while (current := rss(server)) > baseline + tolerance and time.monotonic() < deadline:
        time.sleep(0.1)
    return current


def huge_request() -> runtime_pb2.ExpertRequest:
    return make_request(UIDS, [torch.zeros(1, HUGE_TOKENS, 64), torch.empty(0)], {})


@pytest.mark.parametrize("method", ["rpc_forward_stream", "rpc_backward_stream"])
def test_a_huge_stream_is_refused_early_and_memory_returns(swarm, method):
    server, client = swarm
    client.forward(server.peer_id, UIDS, torch.randn(1, 3, 64))  # warm up
    baseline = rss(server)
    request = huge_request()
    parts = request_parts(request.uid, list(request.tensors), request.metadata)
    assert len(parts) > 40  # sent as ~2 MiB parts, as Petals clients send them
    limit = max_request_bytes(MAX_BATCH_SIZE, 64, len(UIDS))
    # the server answers with the error and closes the stream; the sender may see either first
    with pytest.raises((P2PHandlerError, ConnectionError)):
        client.call_stream(server.peer_id, method, parts)
    server.wait_for_log(f"{method} from")
    assert f"more than {limit} bytes" in server.wait_for_log(f"more than {limit} bytes")
    assert settled_rss(server, baseline, 32 * 2**20) < baseline + 32 * 2**20
    assert client.forward(server.peer_id, UIDS, torch.randn(1, 3, 64)).shape == (1, 3, 64)


def test_a_huge_single_message_is_refused_unread(swarm):
    server, client = swarm
    baseline = rss(server)
    with pytest.raises((P2PHandlerError, P2PDaemonError, ConnectionError, EOFError)):
        client.call_stream(server.peer_id, "rpc_forward_stream", [huge_request()])
    server.wait_for_log("Refused a ")
    assert settled_rss(server, baseline, 32 * 2**20) < baseline + 32 * 2**20
    assert client.forward(server.peer_id, UIDS, torch.randn(1, 3, 64)).shape == (1, 3, 64)


def test_refusals_are_logged_in_one_short_line(swarm):
    server, client = swarm
    long_adapter = "a" * 100_000
    request = make_request(UIDS, [torch.randn(1, 2, 64), torch.empty(0)], {"active_adapter": long_adapter})
    with pytest.raises(P2PHandlerError, match="unknown adapter"):
        client.call_stream(server.peer_id, "rpc_forward_stream", [request])
    line = server.wait_for_log("unknown adapter")
    assert len(line) < 500 and "100002 characters" in line

    session_id = "s" * 5000
    first = client.inference(server.peer_id, UIDS, max_length=8, session_id=session_id)
    first.step(torch.randn(1, 1, 64))
    second = client.inference(server.peer_id, UIDS, max_length=8, session_id=session_id)
    with pytest.raises(P2PHandlerError, match="is already open on this server"):
        second.step(torch.randn(1, 1, 64))
    assert first.step(torch.randn(1, 1, 64)).shape == (1, 1, 64)  # the open session is untouched
    first.close()
    server.wait_for_log("is already open")
    assert "Traceback" not in server.log and "ERROR" not in server.log, server.log


def test_metadata_values_are_cut_in_errors(swarm):
    server, client = swarm
    request = runtime_pb2.ExpertRequest(
        uid=" ".join(UIDS),
        tensors=make_request(UIDS, [torch.randn(1, 2, 64)], {}).tensors,
        metadata=write_metadata({"session_id": 7, "step_id": str(uuid.uuid4()), "points": "x" * 10_000}),
    )
    with pytest.raises(P2PHandlerError) as refusal:
        client.call(server.peer_id, "rpc_forward", request)
    assert "invalid value" in str(refusal.value) and len(str(refusal.value)) < 400
