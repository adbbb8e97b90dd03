"""No session fails for memory: clients that together need more KV cache than the swarm has all complete,
with the tokens of local greedy generation, and nobody is banned or told that blocks are missing.

Servers of the tiny Llama whose budget holds about three sessions of ``PROMPT`` + ``NEW_TOKENS`` tokens
(``ROOM``); eight clients at once. Their sessions wait in the servers' lines, are preempted and replayed
(``[preempted]``), and go on; through the Python client, through ``petals api`` streams, and with one
server killed mid-run. How long it takes is measured by ``benchmarks/cache_pressure.py``, not here.
"""

from __future__ import annotations

import json
import threading
import time

import httpx2
import pytest
import torch
from hivemind.p2p import P2PHandlerError
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import LOOPBACK_CLIENT, KillServingServer, inprocess_swarm, swarm_with_processes
from petals import AutoDistributedModelForCausalLM
from petals.client.routing import Verdict, judge_failure
from petals.data_structures import make_uids
from petals.testing.swarm import start_api
from petals.testing.wire_client import WireClient

CLIENTS, ROOM = 8, 3
PROMPT, NEW_TOKENS, PAGE_TOKENS = 8, 40, 16
BUDGET = ("--attn_cache_tokens", str(ROOM * (PROMPT + NEW_TOKENS)))  # 3 sessions of 3 pages a block
GREEDY = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}


def prompts(vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (1, PROMPT), generator=generator) for _ in range(CLIENTS)]


def generate_at_once(model, inputs: list[torch.Tensor], **options) -> dict[int, list[int] | BaseException]:
    """Every input generated at the same time, a thread each: tokens, or the error it ended with."""
    results: dict[int, list[int] | BaseException] = {}

    def run(index: int) -> None:
        try:
            results[index] = model.generate(inputs[index], **GREEDY, **options)[0].tolist()
        except BaseException as error:
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return results


def preemptions(wire: WireClient, servers) -> int:
    return sum(wire.info(server.peer_id)["stats"]["sessions_preempted"] for server in servers)


def test_memory_refusals_are_retried_without_a_ban_and_waited_for_as_long_as_the_server_says():
    preempted = P2PHandlerError("[preempted] this session's pages went to an older session that needed them")
    assert judge_failure(preempted) == Verdict(retry=True, ban=False, wait=0.0)
    full = P2PHandlerError(
        "[cache_full] not enough KV cache: this session's first step needs 64.0 KiB (2 pages), 0 bytes are "
        "free; 3 sessions wait ahead in line; expect room in about 4.5 s; try again later or another server"
    )
    assert judge_failure(full, only_server=True) == Verdict(retry=True, ban=False, wait=4.5)
    assert judge_failure(full, only_server=False) == Verdict(retry=True, ban=False, wait=0.0)  # go elsewhere
    never = P2PHandlerError(
        "[cache_full] this session needs 9.0 MiB of cache (1 × 9000 tokens: 1 × 563 pages of 16.0 KiB) but "
        "the server's whole budget is 8.0 MiB; use a smaller max_length or batch"
    )
    assert judge_failure(never, only_server=False) == Verdict(retry=True, ban=True)
    assert judge_failure(never, only_server=True) == Verdict(retry=False, ban=False)


@pytest.fixture(scope="module")
def local(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), dtype=torch.float32).eval()


def test_eight_clients_on_two_servers_of_cache_for_two_all_complete_with_local_greedy_tokens(
    tiny_model_path, local
):
    """Two servers of every block, each with room for two of the eight sessions: a server that preempts a
    session is no faulty server, so neither is banned (both banned, a request would be refused)."""
    path = tiny_model_path("llama")
    inputs = prompts(local.config.vocab_size)
    budget = ("--attn_cache_tokens", str(2 * (PROMPT + NEW_TOKENS)))
    with inprocess_swarm(path, "0:4", "0:4", server_args=budget) as (dht, servers):
        wire = WireClient(dht.initial_peers)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        try:
            results = generate_at_once(model, inputs)
            assert preemptions(wire, servers) > 0  # the cache was too small for them all
            assert not model.remote_blocks.manager.bans  # memory is nobody's fault
        finally:
            model.close()
            wire.close()
    for index, prompt in enumerate(inputs):
        assert results[index] == local.generate(prompt, **GREEDY)[0].tolist(), (
            f"client {index}: {results[index]}"
        )


def test_a_full_server_whose_record_says_so_is_waited_for_not_reported_missing(tiny_model_path, local):
    """A client whose view of the swarm says no server has cache left (the record of a server full at the
    time) opens its session anyway and waits in the server's line until the pages are free."""
    path = tiny_model_path("llama")
    budget = ("--attn_cache_tokens", "128", "--update_period", "1")
    with inprocess_swarm(path, "0:4", server_args=budget) as (dht, (server,)):
        holder = WireClient(dht.initial_peers)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, request_timeout=60, **LOOPBACK_CLIENT
        )
        manager = model.remote_blocks.manager
        try:
            every_page = holder.inference(server.peer_id, make_uids("tiny-llama-hf", 0, 4), max_length=128)
            every_page.step(torch.randn(1, 128, 64))
            while not announced_full(manager):
                time.sleep(0.2)
            threading.Timer(1.0, every_page.close).start()  # the pages are free a second from now
            (prompt,) = prompts(local.config.vocab_size, seed=1)[:1]
            output = model.generate(prompt, **GREEDY)
            assert announced_full(manager, refresh=False)  # the client's view was stale all along
        finally:
            model.close()
            holder.close()
    assert torch.equal(output, local.generate(prompt, **GREEDY))


def test_a_session_waiting_in_line_gets_pages_as_soon_as_their_session_is_kept(tiny_model_path):
    """Kept pages are available: closing a session with keep lets the next in line in at once (not when
    its alloc_timeout runs out)."""
    with inprocess_swarm(tiny_model_path("llama"), "0:4", server_args=("--attn_cache_tokens", "128")) as (
        dht,
        (server,),
    ):
        client, uids = WireClient(dht.initial_peers), make_uids("tiny-llama-hf", 0, 4)
        try:
            holder = client.inference(server.peer_id, uids, max_length=128)
            holder.step(torch.randn(1, 128, 64))  # every page
            waiting = client.inference(server.peer_id, uids, max_length=32, alloc_timeout=600)
            answered = threading.Thread(target=waiting.step, args=(torch.randn(1, 4, 64),))
            answered.start()
            while client.info(server.peer_id)["cache_queue"]["waiting"] == 0:
                time.sleep(0.1)
            holder.close(keep="for later")
            answered.join(timeout=60)  # the server waits up to its request_timeout (180 s) otherwise
            assert not answered.is_alive() and waiting.steps == 1
            waiting.close()
        finally:
            client.close()


def announced_full(manager, refresh: bool = True) -> bool:
    if refresh:
        manager.network.run(manager.update())
    return [span.server_info.cache_tokens_left for span in manager.spans.values()] == [0]


@pytest.mark.slow
def test_eight_clients_complete_although_a_server_is_killed_mid_run(tiny_model_path, local):
    path = tiny_model_path("llama")
    inputs = prompts(local.config.vocab_size, seed=2)
    server_args = (*BUDGET, "--update_period", "3")
    swarm = swarm_with_processes(path, "0:2", "2:4", "2:4", processes=2, server_args=server_args)
    with swarm as (dht, servers):
        model = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, request_timeout=30, **LOOPBACK_CLIENT
        )
        try:
            results: dict = {}
            others = threading.Thread(target=lambda: results.update(generate_at_once(model, inputs[1:])))
            with model.inference_session(max_length=PROMPT + NEW_TOKENS) as session:
                killer = KillServingServer(session, servers, PROMPT, kill_after=NEW_TOKENS // 2)
                others.start()
                first = model.generate(inputs[0], stopping_criteria=[killer], **GREEDY)[0].tolist()
                others.join(timeout=300)
        finally:
            model.close()
    assert killer.killed is not None, "no server was killed"
    outputs = [first, *(results[index] for index in range(CLIENTS - 1))]
    for index, prompt in enumerate(inputs):
        assert outputs[index] == local.generate(prompt, **GREEDY)[0].tolist(), (
            f"client {index}: {outputs[index]}"
        )


# ---- through petals api --------------------------------------------------------------------------


@pytest.mark.slow
def test_eight_api_streams_on_cache_for_three_all_complete_with_local_greedy_text(chat_model_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_path)
    local = AutoModelForCausalLM.from_pretrained(chat_model_path, dtype=torch.float32).eval()
    inputs = prompts(len(tokenizer), seed=3)
    texts: dict[int, list[str]] = {}
    statuses: dict[int, int] = {}
    with (
        inprocess_swarm(chat_model_path, "0:2", "2:4", server_args=BUDGET) as (dht, servers),
        start_api(chat_model_path, dht.initial_peers) as api,
    ):

        def stream(index: int) -> None:
            body = {
                "model": chat_model_path.name,
                "prompt": inputs[index][0].tolist(),
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "stream": True,
            }
            with httpx2.stream("POST", f"{api.url}/v1/completions", json=body, timeout=300) as response:
                statuses[index] = response.status_code
                events = [
                    line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
                ]
            texts[index] = events  # every server-sent event, the error one if any

        wire = WireClient(dht.initial_peers)
        try:
            threads = [threading.Thread(target=stream, args=(index,)) for index in range(CLIENTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
            assert list(statuses.values()) == [200] * CLIENTS  # every stream started
            assert preemptions(wire, servers) > 0
        finally:
            wire.close()
    for index, prompt in enumerate(inputs):
        events = texts[index]
        assert events[-1] == "[DONE]" and not any('"error"' in event for event in events), events[-3:]
        streamed = "".join(_text(event) for event in events[:-1])
        expected = local.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT:]
        assert streamed == tokenizer.decode(expected, skip_special_tokens=True), f"stream {index} differs"


def _text(event: str) -> str:
    choices = json.loads(event)["choices"]
    return choices[0]["text"] if choices else ""
