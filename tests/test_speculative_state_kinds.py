"""Speculative decoding over fixed-size states is exact in a real swarm.

A server keeps a linear-attention or state-space layer's state only as it was at the start of each of its
last steps, but a partly accepted draft rolls the session back to a position inside its last step. The
client then rewinds such a server to that step's start and sends it the accepted positions again, in
front of the next step. With the tiny hybrid models of ``test_swarm_state_kinds`` served by real
``petals serve`` processes (``SERVED``), prompt lookup's greedy tokens equal transformers' plain
greedy ones, and a session rolled back into the middle of a step (twice, the second time inside the
positions sent again) gives transformers' logits for the sequence without the dropped tokens; no server
fails on the way (a server asked to rewind where it cannot refuses, and the client would fail over and
replay everything to a new session).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from test_swarm_state_kinds import MODELS, PROMPT, slow_to_forget
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT, save_random_model
from petals.client.generation import StepStats
from petals.client.server_session import StepStarts
from petals.kv_cache import LinearAttentionSpec, LinearAttentionState
from petals.testing.swarm import running_swarm

NEW_TOKENS = 12
# the servers' blocks; Kimi Linear's latent attention layer (block 2) alone on a server, which rewinds to any
# position, between servers that cannot: the steps that send positions again go to some servers only
SERVED = {kind: ("0:2", "2:4") for kind in MODELS} | {"delta-and-latent-attention": ("0:2", "2:3", "3:4")}
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def repeating_prompt() -> torch.Tensor:
    """A prompt that repeats itself, so that prompt lookup proposes (and the random model rejects) drafts."""
    part = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    return torch.cat([part, part, part[:, :3]], dim=1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_prompt_lookup_and_rollbacks_inside_a_step_equal_transformers(kind, tmp_path, caplog):
    path = save_random_model(MODELS[kind], tmp_path / kind, adjust=slow_to_forget)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = repeating_prompt()
    expected = local.generate(ids, **GREEDY)
    tokens = torch.randint(3, 1000, (1, PROMPT + 6), generator=torch.Generator().manual_seed(8))

    caplog.set_level(logging.WARNING, logger="petals.client")
    with running_swarm(path, *SERVED[kind]) as (dht, _servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, request_timeout=20, **LOOPBACK_CLIENT
        )
        with StepStats(model) as stats:
            output = model.generate(ids, prompt_lookup_num_tokens=3, **GREEDY)
        # a step of four tokens kept to its first one, two more, and a rollback inside those two's step
        # (whose first position the servers were sent again): each time the servers must forget exactly
        # the dropped tokens
        with torch.no_grad(), model.inference_session(max_length=PROMPT + 6) as session:
            model(tokens[:, :PROMPT])
            model(tokens[:, PROMPT : PROMPT + 4])
            session.rollback(PROMPT + 1)
            after_first = model(tokens[:, PROMPT + 4 : PROMPT + 6]).logits
            session.rollback(PROMPT + 2)
            after_second = model(tokens[:, PROMPT + 1 : PROMPT + 3]).logits
        model.close()

    failures = [record.getMessage() for record in caplog.records if record.name.startswith("petals.client")]
    assert not failures, failures
    assert stats.rolled_back(output.shape[1]) > 0, f"no draft was rejected: steps of {stats.lengths}"
    assert torch.equal(output, expected)
    with torch.no_grad():
        kept = tokens[:, : PROMPT + 1]
        first = torch.cat([kept, tokens[:, PROMPT + 4 : PROMPT + 6]], dim=1)
        second = torch.cat([first[:, : PROMPT + 2], tokens[:, PROMPT + 1 : PROMPT + 3]], dim=1)
        expected_first = local(first).logits[:, -2:]
        expected_second = local(second).logits[:, -2:]
    assert (after_first - expected_first).abs().max().item() < 1e-4
    assert (after_second - expected_second).abs().max().item() < 1e-4


@pytest.mark.parametrize("snapshots", [0, 1, 4])
def test_the_client_rewinds_a_state_to_the_latest_position_it_keeps(snapshots):
    """``StepStarts`` follows a server's state through random steps and rollbacks: the client asks for the
    latest position at or before the rollback that the state keeps, which the state then rewinds to."""
    spec = LinearAttentionSpec(conv_dim=2, conv_kernel=2, recurrent_shape=None, snapshots=snapshots)
    state, starts = LinearAttentionState(spec, batch_size=1, max_length=10_000), StepStarts()
    rng = random.Random(0)
    position = 0  # the client's; the server's is behind it after a rollback, until the next step
    for _ in range(300):
        if rng.random() < 0.6 or position == 0:
            new = rng.randint(1, 4)
            start = state.length
            state.snapshot()  # what a step on the server does first
            state.stepped(position + new - start)
            starts.stepped(start)
            position += new
            continue
        position = rng.randint(0, position)
        kept = {0, *(kept for kept, _ in state.snapshots)}
        point = starts.rewind_point(position, snapshots)
        assert point == max(start for start in kept if start <= position)
        state.rewind(point)
