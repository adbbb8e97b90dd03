"""PETALS_TRACE: a traced generation reports the client's and every server's timings per step."""

from __future__ import annotations

import pytest
import torch

import petals
from conftest import LOOPBACK_CLIENT, running_swarm
from petals import tracing
from petals.client.routing import RemoteSequenceManager

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model(tiny_model_path):
    path = tiny_model_path("llama")
    with running_swarm(path, "0:2", "2:4", env={tracing.TRACE_ENV: "1"}) as (dht, _):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        yield model
        model.close()


def generate(model) -> torch.Tensor:
    ids = torch.randint(3, 1000, (1, 5), generator=torch.Generator().manual_seed(1))
    return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def test_a_traced_step_holds_client_and_server_timings_and_tokens_do_not_change(model, monkeypatch):
    # Whether a push pays compares the first server's announced ping with the client's own pings:
    # on loopback both are noise, so the choice is pinned here (test_server_push tests the choice).
    monkeypatch.setattr(RemoteSequenceManager, "push_pays", lambda self, span, next_peer: True)
    untraced = generate(model)
    with tracing.collect() as steps:
        traced = generate(model)
    assert torch.equal(traced, untraced)
    assert len(steps) == NEW_TOKENS  # the prompt, then one step per new token but the last
    decode = steps[1]
    for name in (
        "client: embeddings",
        "client: LM head + generate logic",
        "client: serialization",
        "client: thread hand-off",
        "client: wait for server 1/2",
        "client: wait for server 2/2",
    ):
        assert decode[name] >= 0
    for server, blocks in (("server 1/2", (0, 1)), ("server 2/2", (2, 3))):
        for name in (
            "queue wait",
            "hand-back to event loop",
            "serialization",
            "parse + checks",
            "total in server",
        ):
            assert decode[f"{server}: {name}"] >= 0
        compute = [decode[f"{server}: compute tiny-llama-hf.{block}"] for block in blocks]
        assert 0 < sum(compute) <= decode[f"{server}: total in server"]
    # the first server's own time is part of the client's wait for it
    assert decode["server 1/2: total in server"] < decode["client: wait for server 1/2"]
    assert decode["server 1/2: push"] >= 0  # it pushed the step into the second server
