"""A conversation continues where it stopped: finished sessions are kept on their servers, and the next
turn computes only what it adds, with the tokens a fresh session would generate.

One in-process swarm of the tiny Llama (blocks 0:2 and 2:4), each server with a budget of 8 pages of 16
tokens a block; one distributed model (one p2p identity: servers keep sessions for the peer that closed
them). Every expectation is plain transformers' greedy generation in this process.
"""

from __future__ import annotations

import json

import httpx2
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import LOOPBACK_CLIENT, inprocess_swarm
from petals import AutoDistributedModelForCausalLM
from petals.client.generation import StepStats
from petals.client.kept_sessions import KeptSessions
from petals.testing.swarm import start_api
from petals.testing.wire_client import WireClient

PAGE_TOKENS, PAGES_PER_BLOCK = 16, 8
GREEDY = {"do_sample": False}


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    budget = ("--attn_cache_tokens", str(PAGE_TOKENS * PAGES_PER_BLOCK))
    with inprocess_swarm(tiny_model_path("llama"), "0:2", "2:4", server_args=budget) as (dht, servers):
        wire = WireClient(dht.initial_peers)
        yield dht, [server.peer_id for server in servers], wire
        wire.close()


@pytest.fixture(scope="module")
def model(swarm, tiny_model_path):
    dht, _, _ = swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_model_path("llama"), initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
    )
    yield model
    model.close()


@pytest.fixture(scope="module")
def local(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), dtype=torch.float32).eval()


def stat(swarm, name: str) -> int:
    _, servers, wire = swarm
    return sum(wire.info(server)["stats"][name] for server in servers)


def words(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1000, (1, count), generator=torch.Generator().manual_seed(seed))


def reply(generator, conversation: torch.Tensor, new_tokens: int, **options) -> torch.Tensor:
    with torch.no_grad():
        return generator.generate(
            conversation, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **GREEDY, **options
        )


def test_each_turn_continues_the_kept_session_and_computes_only_what_it_adds(swarm, model, local):
    chats = KeptSessions()
    conversation, resumed = words(20, seed=0), stat(swarm, "sessions_resumed")
    for turn in range(4):
        with StepStats(model) as steps:
            output = reply(model, conversation, 6, kept_sessions=chats)
        assert torch.equal(output, reply(local, conversation, 6)), f"turn {turn} differs from a fresh session"
        # the first step sends the last token of the previous answer and the new message, nothing earlier
        assert steps.lengths[0] == (20 if turn == 0 else 1 + 5)
        conversation = torch.cat([output, words(5, seed=turn + 1)], dim=1)
    assert chats.continued == 3 and len(chats) == 1
    assert stat(swarm, "sessions_resumed") == resumed + 3 * 2  # each turn, on both servers


def test_a_conversation_edited_midway_continues_from_where_it_differs(swarm, model, local):
    chats = KeptSessions()
    conversation = reply(model, words(30, seed=10), 4, kept_sessions=chats)
    edited = conversation.clone()
    edited[0, 20] = (edited[0, 20] + 1) % 1000
    with StepStats(model) as steps:
        output = reply(model, edited, 4, kept_sessions=chats)
    assert torch.equal(output, reply(local, edited, 4))
    assert steps.lengths[0] == edited.shape[1] - 20 and chats.reused_tokens == 20


def test_a_conversation_whose_pages_were_lent_away_is_sent_again_without_an_error(swarm, model, local):
    """Kept pages are lent: a session needing every page of the servers takes them back, and the next
    turn finds the servers holding nothing of it; they are sent its history again, from the client."""
    _, servers, wire = swarm
    chats = KeptSessions()
    conversation = reply(model, words(24, seed=20), 8, kept_sessions=chats)
    with model.inference_session(max_length=PAGE_TOKENS * PAGES_PER_BLOCK) as session:
        session.step(torch.randn(1, PAGE_TOKENS * PAGES_PER_BLOCK, 64))  # every page of both servers
        assert [wire.info(server)["cache_pages"]["kept"] for server in servers] == [0, 0]
    conversation = torch.cat([conversation, words(5, seed=21)], dim=1)
    output = reply(model, conversation, 8, kept_sessions=chats)
    assert torch.equal(output, reply(local, conversation, 8))
    assert chats.continued == 1


def test_resending_the_history_inside_a_session_continues_it_instead_of_appending(model, local):
    first = words(10, seed=30)
    with model.inference_session(max_length=64) as session:
        answer = reply(model, first, 5)
        history = torch.cat([answer, words(10, seed=31)], dim=1)  # 25 tokens: all of it sent again
        output = reply(model, history, 5)
        assert session.position == history.shape[1] + 5 - 1  # not 15 + 25 + ...: nothing appended twice
    assert torch.equal(output, reply(local, history, 5))  # the whole sequence, as generate returns it


def test_a_session_opened_with_keep_is_continued_by_passing_it_again(swarm, model, local):
    first = words(12, seed=40)
    with model.inference_session(max_length=32, keep=True) as session:
        answer = reply(model, first, 4)
    assert session.kept
    more = words(6, seed=41)
    resumed = stat(swarm, "sessions_resumed")
    continued = reply(model, more, 4, session=session)  # appended to what the session has seen
    expected = reply(local, torch.cat([answer, more], dim=1), 4)
    assert torch.equal(continued, expected[:, answer.shape[1] :])
    assert stat(swarm, "sessions_resumed") == resumed + 2


def test_kept_sessions_are_bounded_by_count_and_idle_time(model):
    now = [0.0]
    chats = KeptSessions(max_sessions=2, idle_seconds=60, clock=lambda: now[0])
    conversations = [reply(model, words(8, seed=50 + index), 2, kept_sessions=chats) for index in range(3)]
    assert len(chats) == 2  # the least recently used went first
    assert chats.take(conversations[0]) is None and chats.take(conversations[2]) is not None
    now[0] = 61.0
    assert len(chats) == 0
    # a shared beginning alone does not take another conversation's session
    chats = KeptSessions()
    reply(model, words(16, seed=60), 2, kept_sessions=chats)
    assert chats.take(torch.cat([words(16, seed=60)[:, :4], words(20, seed=61)], dim=1)) is None


def test_an_openai_chat_through_petals_api_continues_its_kept_session_each_turn(chat_model_path):
    """Each turn resends the whole conversation (as an OpenAI client does); the API continues the session
    the previous turn kept, and its replies are local greedy replies. The same request sent twice
    continues too: the first request's end (its client leaving) does not cancel the kept session."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model_path)
    local = AutoModelForCausalLM.from_pretrained(chat_model_path, dtype=torch.float32).eval()
    messages = [{"role": "system", "content": "You answer briefly. " * 8}]
    with (
        inprocess_swarm(chat_model_path, "0:2", "2:4") as (dht, _),
        start_api(chat_model_path, dht.initial_peers) as api,
        httpx2.Client(base_url=api.url, timeout=300) as http,
    ):
        for turn, question in enumerate(["Where is it?", "And when?", "And when?"]):
            if turn < 2:
                messages.append({"role": "user", "content": question})
            body = {"model": chat_model_path.name, "messages": messages, "max_tokens": 6, "temperature": 0}
            answer = _streamed(http, {**body, "stream": True})
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            expected = local.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1] :]
            assert answer == tokenizer.decode(expected, skip_special_tokens=True), f"turn {turn}"
            if turn == 0:
                messages.append({"role": "assistant", "content": answer})
            metrics = _metrics(http)
            assert metrics["petals_api_sessions_continued_total"] == turn
        assert metrics["petals_api_reused_tokens_total"] > 2 * prompt.shape[1] // 2


def _streamed(http: httpx2.Client, body: dict) -> str:
    """The text of a streamed chat completion (``stream``: its client leaves as the stream ends)."""
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-2:]
    deltas = [json.loads(event)["choices"] for event in events[:-1]]
    return "".join(choices[0]["delta"].get("content") or "" for choices in deltas if choices)


def _metrics(http: httpx2.Client) -> dict[str, float]:
    lines = http.get("/metrics").text.splitlines()
    return {
        name: float(value)
        for name, value in (line.split() for line in lines if line.startswith("petals_api"))
    }
