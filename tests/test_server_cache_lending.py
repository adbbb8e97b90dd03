"""A server's cache under load, over the wire: sessions that together need more pages than it has all
complete (the newest gives its pages up and is replayed: by a wire client here, and by the Python client
as it is), a silent client's pages are lent within seconds, sessions wait for room in line, and a
session closed with ``keep`` is continued by its client.

One in-process server of the tiny Llama's four blocks with a budget of 6 pages of 16 tokens a block (24
pages its blocks share); clients speak Petals' wire protocol (``petals.testing.wire_client``), plus the
optional fields of ours.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from transformers import AutoModelForCausalLM

from conftest import inprocess_swarm
from petals import AutoDistributedModelForCausalLM
from petals.data_structures import make_uids
from petals.testing import LOOPBACK_CLIENT
from petals.testing.wire_client import WireClient

UIDS = make_uids("tiny-llama-hf", 0, 4)
HIDDEN, PAGE_TOKENS, PAGES_PER_BLOCK = 64, 16, 6
PROMPT, NEW_TOKENS = 8, 40  # a session of 48 tokens holds 3 pages a block: the server holds two at once


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    budget = ("--attn_cache_tokens", str(PAGE_TOKENS * PAGES_PER_BLOCK))
    with inprocess_swarm(tiny_model_path("llama"), "0:4", server_args=budget) as (dht, (server,)):
        client = WireClient(dht.initial_peers)
        client.server, client.initial_peers = server.peer_id, dht.initial_peers
        yield client
        client.close()


@pytest.fixture(scope="module")
def local(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), dtype=torch.float32).eval()


def info(client: WireClient) -> dict:
    return client.info(client.server)


def wait_until(condition, timeout: float = 10) -> float:
    """Seconds until ``condition()`` held (polled); fails after ``timeout``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "the server's state did not change in time"
        time.sleep(0.1)
    return time.monotonic() - started


def all_pages_free(client: WireClient) -> bool:
    pages = info(client)["cache_pages"]
    return pages["live"] == 0 and pages["kept"] == 0


@torch.no_grad()
def local_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0].tolist()


@torch.no_grad()
def swarm_greedy(client: WireClient, model, prompt: list[int], new_tokens: int, replays: list) -> list[int]:
    """Greedy tokens with the server computing every block, as the client does: on ``[preempted]`` the
    session is opened again and its whole history replayed (``replays`` counts those). Sessions wait for
    room in the server's line (``alloc_timeout``)."""
    ids = list(prompt)
    embed, norm, head = model.get_input_embeddings(), model.model.norm, model.lm_head
    while len(ids) < len(prompt) + new_tokens:
        stream = client.inference(client.server, UIDS, max_length=PROMPT + NEW_TOKENS, alloc_timeout=60)
        try:
            hidden = stream.step(embed(torch.tensor([ids])))
            while True:
                ids.append(int(head(norm(hidden[:, -1])).argmax()))
                if len(ids) == len(prompt) + new_tokens:
                    break
                hidden = stream.step(embed(torch.tensor([ids[-1:]])))
            stream.close()
        except P2PHandlerError as error:
            assert "[preempted]" in str(error), error
            replays.append(len(ids))
    return ids


def test_sessions_needing_more_pages_than_the_server_has_all_complete_with_local_greedy_tokens(swarm, local):
    preempted = info(swarm)["stats"]["sessions_preempted"]
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, local.config.vocab_size, (PROMPT,), generator=generator).tolist() for _ in range(4)
    ]
    replays: list[int] = []
    results: dict[int, list[int]] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.update(
                {i: swarm_greedy(swarm, local, prompts[i], NEW_TOKENS, replays)}
            )
        )
        for i in range(len(prompts))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(results) == list(range(len(prompts))), "a session failed"
    for index, prompt in enumerate(prompts):
        assert results[index] == local_greedy(local, prompt, NEW_TOKENS), f"session {index} differs"
    stats = info(swarm)["stats"]
    assert stats["sessions_preempted"] > preempted and replays  # four sessions of three pages in six
    wait_until(lambda: all_pages_free(swarm))


def test_the_python_client_replays_its_preempted_sessions_and_generates_the_local_greedy_tokens(
    swarm, local, tiny_model_path
):
    preempted = info(swarm)["stats"]["sessions_preempted"]
    model = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_model_path("llama"), initial_peers=swarm.initial_peers, **LOOPBACK_CLIENT
    )
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, local.config.vocab_size, (1, PROMPT), generator=generator) for _ in range(4)]
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    results: dict[int, list[int]] = {}
    try:
        threads = [
            threading.Thread(
                target=lambda i=i: results.update({i: model.generate(prompts[i], **greedy)[0].tolist()})
            )
            for i in range(len(prompts))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        model.remote_blocks.network.close()
    assert sorted(results) == list(range(len(prompts))), "a session failed"
    for index, prompt in enumerate(prompts):
        assert results[index] == local.generate(prompt, **greedy)[0].tolist(), f"session {index} differs"
    assert info(swarm)["stats"]["sessions_preempted"] > preempted
    wait_until(lambda: all_pages_free(swarm))


# a client that opens a session of 20 tokens (two pages a block), says so, then waits forever
SILENT_CLIENT = """
import sys, time, torch
from petals.testing.wire_client import WireClient
client = WireClient([sys.argv[1]])
stream = client.inference(sys.argv[2], sys.argv[3].split(), max_length=64)
stream.step(torch.randn(1, 20, 64))
print("ready", flush=True)
time.sleep(600)
"""


def test_a_silent_clients_pages_are_lent_within_seconds_and_go_to_a_session_that_needs_them(swarm, caplog):
    reclaimed = info(swarm)["stats"]["sessions_reclaimed"]
    silent = subprocess.Popen(
        [sys.executable, "-c", SILENT_CLIENT, swarm.initial_peers[0], swarm.server, " ".join(UIDS)],
        stdout=subprocess.PIPE,
        start_new_session=True,  # its own process group: its p2p daemon stops with it
    )
    try:
        assert silent.stdout.readline() == b"ready\n"
        with caplog.at_level(logging.INFO, logger="petals.server.handler"):
            os.killpg(silent.pid, signal.SIGSTOP)  # the client and its p2p daemon: not a byte more
            seconds = wait_until(lambda: info(swarm)["cache_pages"]["kept"] == 4 * 2)
            assert seconds < 10
            assert any(
                "silent for 5 s: its 8 pages are lent" in record.getMessage() for record in caplog.records
            )
        greedy = swarm.inference(swarm.server, UIDS, max_length=PAGE_TOKENS * PAGES_PER_BLOCK)
        greedy.step(torch.randn(1, PAGE_TOKENS * PAGES_PER_BLOCK, HIDDEN))  # every page, the lent ones too
        assert info(swarm)["stats"]["sessions_reclaimed"] == reclaimed + 1
        greedy.close()
    finally:
        os.killpg(silent.pid, signal.SIGKILL)
        silent.wait(timeout=30)
    wait_until(lambda: all_pages_free(swarm), timeout=60)  # its stream ends once libp2p notices


def test_a_session_that_cannot_open_yet_waits_in_line_and_is_told_how_long(swarm):
    holder = swarm.inference(swarm.server, UIDS, max_length=PAGE_TOKENS * PAGES_PER_BLOCK)
    holder.step(torch.randn(1, PAGE_TOKENS * PAGES_PER_BLOCK, HIDDEN))  # every page
    with pytest.raises(P2PHandlerError, match=r"\[cache_full\] not enough KV cache.*expect room in about"):
        swarm.inference(swarm.server, UIDS, max_length=32).step(torch.randn(1, 1, HIDDEN))
    waiting = swarm.inference(swarm.server, UIDS, max_length=32, alloc_timeout=30)
    output: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: output.append(waiting.step(torch.randn(1, 1, HIDDEN))))
    thread.start()
    wait_until(lambda: info(swarm)["cache_queue"]["waiting"] == 1)
    assert info(swarm)["cache_queue"]["wait_seconds"] > 0
    holder.close()
    thread.join(timeout=30)
    assert output and output[0].shape == (1, 1, HIDDEN)
    waiting.close()
    wait_until(lambda: all_pages_free(swarm))


def test_a_session_closed_with_keep_is_continued_by_its_own_client_only(swarm):
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, length, HIDDEN, generator=generator) for length in (12, 1, 1, 1)]
    whole = swarm.inference(swarm.server, UIDS, max_length=32)
    expected = [whole.step(hidden) for hidden in inputs]
    whole.close()

    first = swarm.inference(swarm.server, UIDS, max_length=32)
    for hidden in inputs[:3]:
        first.step(hidden)
    first.close(keep="chat-1")  # 14 tokens kept: one page a block
    wait_until(lambda: info(swarm)["cache_pages"]["kept"] == 4)
    stranger = WireClient(swarm.initial_peers)  # another peer: its key finds nothing of ours
    try:
        theirs = stranger.inference(
            swarm.server, UIDS, max_length=32, resume={"key": "chat-1", "position": 13}
        )
        assert theirs.step(inputs[2]).shape == (1, 0, HIDDEN) and theirs.reply == {"position": 0}
        theirs.close()
    finally:
        stranger.close()
    ours = swarm.inference(swarm.server, UIDS, max_length=32, resume={"key": "chat-1", "position": 13})
    redone = ours.step(inputs[2])  # the last kept step again, from one token back
    assert ours.reply == {"position": 13}
    assert (redone - expected[2]).abs().max() <= 1e-5
    assert (ours.step(inputs[3]) - expected[3]).abs().max() <= 1e-5
    ours.close()
    assert info(swarm)["stats"]["sessions_resumed"] >= 1
    wait_until(lambda: all_pages_free(swarm))
