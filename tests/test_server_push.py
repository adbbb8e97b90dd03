"""Server-to-server pushes and ``next_pings`` in a two-server swarm (blocks 0:2 and 2:4)."""

from __future__ import annotations

import math
import time
import types

import pytest
import torch
from hivemind.p2p import PeerID
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT, running_swarm
from petals.auto import AutoDistributedConfig
from petals.client.inference_session import InferenceSession
from petals.client.routing import RemoteSequenceManager
from petals.client.server_session import ServerSession
from petals.data_structures import RemoteSpanInfo, ServerInfo, ServerState
from petals.testing.wire_client import WireClient, make_request

NEW_TOKENS = 24
PREFIX = "tiny-llama-hf"
HIDDEN = 64
PEERS = [PeerID(name).to_base58() for name in (b"first", b"second", b"third")]


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    path = tiny_model_path("llama")
    with running_swarm(path, "0:2", "2:4", server_args=("--update_period", "2")) as (dht, servers):
        client = WireClient(dht.initial_peers)
        yield path, dht, servers, client
        client.close()


def generate(swarm, **config) -> torch.Tensor:
    path, dht, _, _ = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT, **config
    )
    try:
        ids = torch.randint(3, 1000, (1, 5), generator=torch.Generator().manual_seed(3))
        return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        model.close()


def stats(swarm) -> list[dict[str, int]]:
    _, _, servers, client = swarm
    return [client.info(server.peer_id)["stats"] for server in servers]


def local_generate(swarm) -> torch.Tensor:
    local = AutoModelForCausalLM.from_pretrained(swarm[0], dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (1, 5), generator=torch.Generator().manual_seed(3))
    return local.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before}


def test_first_server_pushes_into_the_second_and_each_step_runs_once(swarm, monkeypatch):
    # On loopback the announced ping and the client's pings it is compared with are all noise: pin
    # the choice (test_pushes_go_only_where_they_arrive_before_the_clients_copy tests it).
    monkeypatch.setattr(RemoteSequenceManager, "push_pays", lambda self, span, next_peer: True)
    before = stats(swarm)
    assert torch.equal(generate(swarm), local_generate(swarm))
    first, second = (delta(after, earlier) for after, earlier in zip(stats(swarm), before, strict=True))
    steps = NEW_TOKENS  # the prompt, then one step per generated token but the last
    # plus the empty step that opens each server's session ahead, so that the prompt is pushed too
    assert first["inference_steps"] == second["inference_steps"] == steps + 1
    assert first["pushes_sent"] == steps
    assert second["steps_from_pushes"] > 0  # the pushed copy won the race and was used
    # the copy that lost the race was dropped (the last push may find the session closed already)
    assert steps - 1 <= second["duplicate_steps_dropped"] <= steps


def test_no_pushes_without_server_to_server(swarm):
    before = stats(swarm)
    assert torch.equal(generate(swarm, use_server_to_server=False), local_generate(swarm))
    first, second = (delta(after, earlier) for after, earlier in zip(stats(swarm), before, strict=True))
    assert first["pushes_sent"] == second["steps_from_pushes"] == second["duplicate_steps_dropped"] == 0
    assert second["inference_steps"] == NEW_TOKENS


def test_servers_announce_pings_to_the_next_servers(swarm):
    _, _, (first, second), client = swarm

    def announced(server) -> dict[str, float] | None:
        entry = client.dht_get(f"{PREFIX}.{0 if server is first else 3}").value
        return ServerInfo.from_tuple(entry[server.peer_id].value).next_pings

    deadline = time.monotonic() + 20
    while not (announced(first) or {}).get(second.peer_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    pings = announced(first)
    assert set(pings) == {second.peer_id}
    assert type(pings[second.peer_id]) is float and 0 < pings[second.peer_id] < math.inf
    assert announced(second) == {}  # its span ends the model: nobody comes after it


def test_a_step_computed_before_is_dropped_before_its_tensors_are_decoded(swarm):
    _, _, (_, second), client = swarm
    uids = [f"{PREFIX}.2", f"{PREFIX}.3"]
    stream = client.inference(second.peer_id, uids, max_length=8)
    try:
        before = stats(swarm)[1]["duplicate_steps_dropped"]
        hidden = torch.randn(1, 1, HIDDEN)
        stream.step(hidden, step_id="step-0")
        empty = [torch.empty(0), torch.empty(0, dtype=torch.int64)]
        copy = make_request(uids, [hidden, *empty], {"session_id": stream.session_id, "step_id": "step-0"})
        copy.tensors[0].dtype = "object"  # decoding it would fail the session with a WireError
        stream.post(copy)
        assert stream.step(torch.randn(1, 1, HIDDEN), step_id="step-1").shape == (1, 1, HIDDEN)
        assert stats(swarm)[1]["duplicate_steps_dropped"] == before + 1
    finally:
        stream.close()


def spans_with_pings(path, announced: float | None, client_rtts: tuple[float, float, float]):
    """A session over three servers whose client pinged them ``client_rtts`` and whose first announces
    ``announced`` to the second (the second announces 2 ms to the third)."""
    config = AutoDistributedConfig.from_pretrained(path)
    # routing policy only: no network is used, and an open swarm has no membership to check
    manager = RemoteSequenceManager(config, network=types.SimpleNamespace(membership=None), num_blocks=3)
    peers = [PeerID.from_base58(peer) for peer in PEERS]
    manager.pings = dict(zip(peers, client_rtts, strict=True))
    next_pings = [{PEERS[1]: announced} if announced is not None else None, {PEERS[2]: 0.002}, None]
    spans = [
        RemoteSpanInfo(peer, block, block + 1, ServerInfo(ServerState.ONLINE, 1.0, next_pings=pings))
        for block, (peer, pings) in enumerate(zip(peers, next_pings, strict=True))
    ]
    session = InferenceSession(manager, max_length=8)
    session._sessions = [ServerSession(manager, span, 8) for span in spans]
    for server_session in session._sessions:
        server_session.position = session.position = 4
    return session


def push_targets(session, index: int) -> list[int]:
    return [start for _, _, start, _ in session._next_servers(index) or []]


def test_pushes_go_only_where_they_arrive_before_the_clients_copy(swarm):
    path = swarm[0]
    # the first server is 20 ms from the second; the client is 5 ms from each: its copy arrives first
    session = spans_with_pings(path, announced=0.020, client_rtts=(0.005, 0.005, 0.005))
    assert push_targets(session, 0) == []  # the first server does not push ...
    assert push_targets(session, 1) == [2]  # ... but the second still pushes into the third
    # close servers, a far client: the whole chain pushes
    session = spans_with_pings(path, announced=0.002, client_rtts=(0.040, 0.040, 0.040))
    assert push_targets(session, 0) == [1, 2]
    # nothing announced yet: push, as Petals does (a copy that comes second is dropped unread)
    session = spans_with_pings(path, announced=None, client_rtts=(0.005, 0.005, 0.005))
    assert push_targets(session, 0) == [1, 2]
