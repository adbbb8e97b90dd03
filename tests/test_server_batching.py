"""Sessions at different positions share one forward per block, and pay only for the pages they use.

One server with a small KV-cache budget (10 pages of 16 tokens per block, 40 pages its 4 blocks share): sessions of different
lengths and batch sizes step together and each gets exactly what it gets alone; a session that finds
no free page takes the pages of the most recently admitted one, which fails alone as preempted, and
whose replay on a new session computes exactly what it computed alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hivemind.p2p import P2PHandlerError

from conftest import inprocess_swarm
from petals.data_structures import make_uids
from petals.testing.wire_client import WireClient

UIDS = make_uids("tiny-llama-hf", 0, 4)
HIDDEN, PAGE_TOKENS, PAGES = 64, 16, 10


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    budget = ("--attn_cache_tokens", str(PAGE_TOKENS * PAGES))
    with inprocess_swarm(tiny_model_path("llama"), "0:4", server_args=budget) as (dht, (server,)):
        client = WireClient(dht.initial_peers)
        client.server = server.peer_id
        yield client
        client.close()


def free_tokens(client: WireClient) -> int:
    return client.info(client.server)["cache_tokens_available"]


def session_inputs(batch_size: int, prompt: int, steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [prompt] + [1] * steps
    return [torch.randn(batch_size, length, HIDDEN, generator=generator) for length in lengths]


def run_session(client: WireClient, inputs: list[torch.Tensor], barrier: threading.Barrier | None = None):
    stream = client.inference(client.server, UIDS, max_length=32)
    outputs = []
    for hidden in inputs:
        if barrier is not None:
            barrier.wait(timeout=60)  # every session sends its step at once: the server merges them
        outputs.append(stream.step(hidden))
    stream.close()
    return outputs


def test_sessions_at_different_positions_merge_and_match_their_solo_runs(swarm):
    sessions = [
        session_inputs(batch, prompt, 12, seed)
        for seed, (batch, prompt) in enumerate([(1, 3), (2, 9), (1, 14)])
    ]
    solo = [run_session(swarm, inputs) for inputs in sessions]
    merged_before = swarm.info(swarm.server)["stats"]["merged_batches"]

    barrier = threading.Barrier(len(sessions))
    results: dict[int, list[torch.Tensor]] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.update({i: run_session(swarm, sessions[i], barrier)}))
        for i in range(len(sessions))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert sorted(results) == list(range(len(sessions))), "a session failed"
    for index, alone in enumerate(solo):
        together = results[index]
        for step, (expected, got) in enumerate(zip(alone, together, strict=True)):
            diff = (got - expected).abs().max().item()
            assert diff <= 1e-5, f"session {index} step {step}: merged output differs from solo by {diff:.3g}"
    assert swarm.info(swarm.server)["stats"]["merged_batches"] > merged_before, "no decode steps were merged"


def test_sessions_take_pages_as_they_grow_and_give_them_back(swarm):
    initial = free_tokens(swarm)
    assert initial == 2 * len(UIDS) * PAGES * PAGE_TOKENS  # Petals' unit: keys and values counted apart
    stream = swarm.inference(swarm.server, UIDS, max_length=64)
    stream.step(torch.randn(1, 5, HIDDEN))
    assert free_tokens(swarm) == initial - 2 * len(UIDS) * PAGE_TOKENS  # one page per block, not 64 tokens
    stream.step(torch.randn(1, 20, HIDDEN))
    assert free_tokens(swarm) == initial - 2 * len(UIDS) * 2 * PAGE_TOKENS
    stream.step(torch.randn(1, 1, HIDDEN), start_from_position=3)  # a rewind gives the second page back
    assert free_tokens(swarm) == initial - 2 * len(UIDS) * PAGE_TOKENS
    stream.close()
    wait_for_free_tokens(swarm, initial)


def test_a_growing_session_preempts_the_newest_one_whose_replay_computes_the_same(swarm):
    initial = free_tokens(swarm)
    neighbour_inputs = session_inputs(1, 16, 6, seed=7)
    alone = run_session(swarm, neighbour_inputs)
    wait_for_free_tokens(swarm, initial)
    preempted = swarm.info(swarm.server)["stats"]["sessions_preempted"]

    greedy = swarm.inference(swarm.server, UIDS, max_length=PAGES * PAGE_TOKENS)
    greedy.step(torch.randn(1, (PAGES - 2) * PAGE_TOKENS, HIDDEN))  # all pages but two
    neighbour = swarm.inference(swarm.server, UIDS, max_length=32)
    together = [neighbour.step(hidden) for hidden in neighbour_inputs[:2]]  # 17 tokens: the last two pages
    greedy.step(torch.randn(1, 1, HIDDEN))  # grows: the most recently admitted session gives its pages up
    with pytest.raises(P2PHandlerError, match=r"\[preempted\] this session's pages went to an older session"):
        neighbour.step(neighbour_inputs[2])
    assert swarm.info(swarm.server)["stats"]["sessions_preempted"] == preempted + 1
    greedy.close()

    replay = swarm.inference(swarm.server, UIDS, max_length=32)  # as its client does: the history, then on
    history = replay.step(torch.cat(neighbour_inputs[:2], dim=1))
    together = [*history.split([16, 1], dim=1), *(replay.step(hidden) for hidden in neighbour_inputs[2:])]
    replay.close()
    for step, (expected, got) in enumerate(zip(alone, together, strict=True)):
        assert (got - expected).abs().max().item() <= 1e-5, f"the replayed session's step {step} differs"
    wait_for_free_tokens(swarm, initial)


def wait_for_free_tokens(client: WireClient, expected: int, timeout: float = 10) -> None:
    """Sessions give their pages back just after they end (in the compute thread)."""
    deadline = time.monotonic() + timeout
    while free_tokens(client) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free_tokens(client) == expected
