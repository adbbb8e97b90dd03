"""Server-to-server pushes and ``next_pings`` in a two-server swarm (blocks 0:2 and 2:4)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT, running_swarm
from petals.data_structures import ServerInfo
from petals.testing.wire_client import WireClient

NEW_TOKENS = 24
PREFIX = "tiny-llama-hf"


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


def test_first_server_pushes_into_the_second_and_each_step_runs_once(swarm):
    before = stats(swarm)
    assert torch.equal(generate(swarm), local_generate(swarm))
    first, second = (delta(after, earlier) for after, earlier in zip(stats(swarm), before, strict=True))
    steps = NEW_TOKENS  # the prompt, then one step per generated token but the last
    assert first["inference_steps"] == second["inference_steps"] == steps
    assert first["pushes_sent"] == steps - 1  # every step but the first (the client sends next_servers)
    assert second["steps_from_pushes"] > 0  # the pushed copy won the race and was used
    # the copy that lost the race was dropped (the last push may find the session closed already)
    assert steps - 2 <= second["duplicate_steps_dropped"] <= steps - 1


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
