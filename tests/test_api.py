"""``petals api``: a real API process in front of a real local swarm, used by real clients.

One swarm (a bootstrap peer and two servers of a tiny Llama that carries SmolLM2's tokenizer and
chat template) and one ``petals api`` process serve the whole module. The OpenAI Python client,
a WebSocket client and headless Chromium talk to it over HTTP on 127.0.0.1; the distributed
Python client in this process is the reference for what the swarm generates.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest
import torch
from transformers import AutoTokenizer

import petals
from benchmarks.chat_model import save_tiny_chat_llama
from conftest import LOOPBACK_CLIENT, inprocess_swarm, launch_chromium
from petals.api.text import StreamingText
from petals.demo_model import prepare_demo_model
from petals.testing.swarm import SwarmProcess, start_api
from petals.testing.wire_client import WireClient

MODEL_ID = "tiny-chat-llama"
MAX_TOKENS = 1000  # the API's cap in this module


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_demo_model())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """A random 4-block Llama over SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    return save_tiny_chat_llama(tmp_path_factory.mktemp("api") / MODEL_ID)


@pytest.fixture(scope="module")
def swarm(model_path):
    with inprocess_swarm(model_path, "0:2", "2:4") as (dht, servers):
        yield dht, servers


@pytest.fixture(scope="module")
def apis(model_path, swarm):
    """Two API processes, started together: one for the swarm, one (with a key) for a model nobody serves."""
    dht, _ = swarm
    with (
        start_api(model_path, dht.initial_peers, "--max_tokens", str(MAX_TOKENS), wait_ready=False) as main,
        start_api(
            model_path,
            dht.initial_peers,
            "--dht_prefix",
            "nobody-serves-this",
            "--api_key",
            "k1",
            wait_ready=False,
        ) as keyed,
    ):
        yield main.wait_ready(), keyed.wait_ready()


@pytest.fixture(scope="module")
def api_url(apis) -> str:
    return apis[0].url


@pytest.fixture(scope="module")
def client(api_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model_path, swarm):
    """The distributed Python client in this process: what the swarm generates, without the API."""
    dht, _ = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
    )
    yield model
    model.close()


def greedy_ids(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return output[0, len(prompt_ids) :].tolist()


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )


# ---- stop strings on decoded text (no swarm) ------------------------------------------------------


def test_stop_string_split_over_tokens_is_cut_and_never_leaked(tokenizer):
    ids = tokenizer("The quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    text = StreamingText(tokenizer, stop=["wn fo"])  # spans the tokens " brown" and " fox"
    released = "".join(text.push(token) for token in ids)
    assert released == "The quick bro" and text.stopped
    assert text.flush() == ""


def test_held_back_text_is_released_when_no_stop_follows(tokenizer):
    ids = tokenizer("Paris, France", add_special_tokens=False)["input_ids"]
    text = StreamingText(tokenizer, stop=["France is"])
    pieces = [text.push(token) for token in ids]
    assert "France" not in "".join(pieces)  # "France" could still become "France is"
    assert "".join(pieces) + text.flush() == "Paris, France" and not text.stopped


def test_incomplete_utf8_characters_wait_for_their_last_byte(tokenizer):
    ids = tokenizer("café 🙂 ok", add_special_tokens=False)["input_ids"]
    text = StreamingText(tokenizer)
    pieces = [text.push(token) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + text.flush() == "café 🙂 ok"


def test_api_help_imports_nothing_heavy():
    check = (
        "import sys; from click.testing import CliRunner; from petals.cli import main; "
        "result = CliRunner().invoke(main, ['api', '--help']); assert '--api_key' in result.output, result.output; "
        "print([m for m in ('torch', 'transformers', 'fastapi', 'uvicorn') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


# ---- the OpenAI API ----------------------------------------------------------------------------


@pytest.mark.slow
def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == [MODEL_ID]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.slow
def test_chat_completion_equals_the_python_client(client, reference, tokenizer):
    prompt_ids = chat_prompt_ids(tokenizer, "What is the capital of France?")
    expected = tokenizer.decode(greedy_ids(reference, prompt_ids, 12), skip_special_tokens=True)
    response = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 12 and response.usage.total_tokens == len(prompt_ids) + 12


@pytest.mark.slow
def test_streamed_completion_equals_the_whole_one_and_reports_usage(client):
    options = dict(model=MODEL_ID, prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.slow
def test_chat_stream_is_server_sent_events_ending_with_done(api_url):
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    with httpx2.stream("POST", f"{api_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first, *_, last = [json.loads(event) for event in events[:-1]]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}


@pytest.mark.slow
def test_stop_sequence_spanning_tokens_ends_the_text_before_it(client, tokenizer):
    options = dict(model=MODEL_ID, prompt="The weather today", max_tokens=24, temperature=0)
    full = client.completions.create(**options).choices[0].text
    token_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    boundary = len(tokenizer.decode(token_ids[:6]))  # between two generated tokens
    stop = full[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    expected = full[: full.index(stop)]

    stopped = client.completions.create(**options, stop=[stop, "never-generated"])
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**options, stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_a_seed_makes_sampling_reproducible(client):
    options = dict(model=MODEL_ID, prompt="Tell me", max_tokens=10, temperature=1.0, top_p=0.9)
    first = client.completions.create(**options, seed=7).choices[0].text
    assert client.completions.create(**options, seed=7).choices[0].text == first


@pytest.mark.slow
def test_bad_requests_get_openai_errors_with_the_right_status(client, api_url):
    chat = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", **chat)
    assert error.value.code == "model_not_found"
    for bad in ({"n": 2}, {"temperature": 5}, {"max_tokens": MAX_TOKENS + 1}, {"tools": [{"type": "x"}]}):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL_ID, **{**chat, **bad})
        assert error.value.status_code == 400 and error.value.body["message"]
    response = httpx2.post(f"{api_url}/v1/completions", content=b"x" * (2 << 20), timeout=30)
    assert response.status_code == 413 and "exceeds" in response.json()["error"]["message"]
    response = httpx2.post(f"{api_url}/v1/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_concurrent_requests_each_get_their_own_session(client):
    prompts = [f"Story number {index}:" for index in range(3)]

    def complete(prompt: str) -> str:
        return (
            client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=8, temperature=0)
            .choices[0]
            .text
        )

    alone = [complete(prompt) for prompt in prompts]
    together: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, complete(prompts[i]))) for i in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [together[i] for i in range(3)] == alone


@pytest.mark.slow
def test_a_client_leaving_mid_stream_frees_the_servers_caches(api_url, swarm, client):
    dht, servers = swarm
    wire = WireClient(dht.initial_peers)
    try:

        def cache_left() -> list[int]:
            return [wire.info(server.peer_id)["cache_tokens_available"] for server in servers]

        idle = cache_left()
        body = {"model": MODEL_ID, "prompt": "A long story:", "max_tokens": MAX_TOKENS, "stream": True}
        with httpx2.stream("POST", f"{api_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            during = cache_left()
        assert all(now < before for now, before in zip(during, idle, strict=True))  # a session was open
        deadline = time.monotonic() + 30
        while (left := cache_left()) != idle and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == idle
        # the model is free again: the next request does not wait for the abandoned one
        assert client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2, temperature=0).choices
    finally:
        wire.close()


# ---- the original Petals chat API ------------------------------------------------------------------


@pytest.mark.slow
def test_http_generate_v1_takes_form_fields_like_the_original(api_url, reference, tokenizer):
    prompt_ids = tokenizer("A cat sat on")["input_ids"]
    expected = tokenizer.decode(greedy_ids(reference, prompt_ids, 5))
    response = httpx2.post(
        f"{api_url}/api/v1/generate", data={"inputs": "A cat sat on", "max_new_tokens": "5"}, timeout=60
    )
    assert response.json() == {"ok": True, "outputs": expected}
    refused = httpx2.post(f"{api_url}/api/v1/generate", json={"inputs": "A cat"}, timeout=60)
    assert refused.status_code == 400  # the original answered 200; its body is kept
    assert refused.json()["ok"] is False and "max_new_tokens or max_length" in refused.json()["traceback"]


@pytest.mark.slow
def test_websocket_v2_keeps_one_session_across_turns(api_url, reference, tokenizer):
    from websockets.sync.client import connect

    first, second = (tokenizer(text)["input_ids"] for text in ("Hello there.", " How are you?"))
    with reference.inference_session(max_length=128):  # what the session should generate, turn by turn
        expected_first = tokenizer.decode(greedy_ids(reference, first, 4))
        expected_second_ids = greedy_ids(reference, second, 12)
    expected_second = tokenizer.decode(expected_second_ids)
    stop = tokenizer.decode(expected_second_ids[4:6])  # ends generation in the middle of the turn
    expected_streamed = expected_second[: expected_second.index(stop) + len(stop)]

    with connect(api_url.replace("http", "ws", 1) + "/api/v2/generate", open_timeout=30) as websocket:

        def exchange(message: dict) -> dict:
            websocket.send(json.dumps(message))
            return json.loads(websocket.recv(timeout=60))

        assert exchange({"type": "open_inference_session", "model": MODEL_ID, "max_length": 128}) == {
            "ok": True
        }
        reply = exchange({"type": "generate", "inputs": "Hello there.", "max_new_tokens": 4})
        assert reply == {"ok": True, "outputs": expected_first, "stop": True, "token_count": 4}

        replies = [
            exchange(
                {"type": "generate", "inputs": " How are you?", "max_new_tokens": 1, "stop_sequence": stop}
            )
        ]
        while not replies[-1]["stop"]:
            replies.append(json.loads(websocket.recv(timeout=60)))
        assert all(reply["ok"] for reply in replies) and len(replies) > 2  # streamed, token by token
        assert "".join(reply["outputs"] for reply in replies) == expected_streamed

        too_long = exchange({"type": "generate", "inputs": "More", "max_new_tokens": 200})
        assert too_long["ok"] is False and "Maximum length exceeded" in too_long["traceback"]


@pytest.mark.slow
def test_closing_a_websocket_mid_answer_frees_the_servers_caches(api_url, swarm):
    from websockets.sync.client import connect

    dht, servers = swarm
    wire = WireClient(dht.initial_peers)
    try:

        def cache_left() -> list[int]:
            return [wire.info(server.peer_id)["cache_tokens_available"] for server in servers]

        idle = cache_left()
        with connect(api_url.replace("http", "ws", 1) + "/api/v2/generate", open_timeout=30) as websocket:
            websocket.send(json.dumps({"type": "open_inference_session", "max_length": 1000}))
            assert json.loads(websocket.recv(timeout=60)) == {"ok": True}
            turn = {
                "type": "generate",
                "inputs": "Go on:",
                "max_new_tokens": 1,
                "stop_sequence": "never-generated",
            }
            websocket.send(json.dumps(turn))
            assert json.loads(websocket.recv(timeout=60))["stop"] is False  # the answer is streaming
            assert all(now < before for now, before in zip(cache_left(), idle, strict=True))
        deadline = time.monotonic() + 30
        while (left := cache_left()) != idle and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == idle
    finally:
        wire.close()


# ---- the chat page in a real browser ----------------------------------------------------------------


@pytest.mark.slow
def test_chat_page_streams_an_answer_into_the_page(api_url, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 600})
            page.goto(api_url)
            page.wait_for_function(f"document.getElementById('model').textContent === '{MODEL_ID}'")
            page.fill("#question", "What is the capital of France?")
            page.keyboard.press("Enter")
            # the answer grows on the page while it is being generated (a random model: it would go on
            # to the token limit, so Stop ends it, which also cancels the generation on the server)
            page.wait_for_function(
                "(() => { const a = document.querySelector('.assistant.streaming'); "
                "return a !== null && a.textContent.length > 40; })()",
                timeout=60_000,
            )
            page.click("#stop")
            page.wait_for_selector(".assistant.done", timeout=30_000)
            assert page.text_content(".user") == "What is the capital of France?"
            assert len(page.text_content(".assistant")) > 40 and page.query_selector(".error") is None
            assert page.is_enabled("#send")
            page.screenshot(path=tmp_path / "chat.png")
        finally:
            browser.close()


# ---- a swarm that lacks blocks, and an API key --------------------------------------------------------


@pytest.mark.slow
def test_missing_blocks_are_a_503_naming_them_and_keys_are_checked(apis):
    url = apis[1].url
    chat = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(**chat)
    assert httpx2.get(url, timeout=30).status_code == 200  # the page itself is public: it asks for the key
    keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as error:
        keyed.chat.completions.create(**chat)
    assert error.value.status_code == 503
    assert "blocks missing: 0-3" in error.value.message and error.value.code == "swarm_missing_blocks"


# ---- petals demo --api ----------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_api_prints_a_curl_command_that_works():
    """SmolLM2 on three servers behind the API; the printed curl command gets a real answer."""
    prepare_demo_model()  # the demo's model, converted once into the default cache
    with SwarmProcess("petals demo --api", ["petals.cli", "demo", "--api", "--port", "0"]) as demo:
        demo.wait_for(
            lambda: any("Chat page:" in line for line in demo.stdout_lines), 300, "the API's address"
        )
        curl = next(line.strip() for line in demo.stdout_lines if line.strip().startswith("curl "))
        page = next(line for line in demo.stdout_lines if "Chat page:" in line).split()[-1]
        answer = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=120)
        assert "Paris" in json.loads(answer.stdout)["choices"][0]["message"]["content"], answer.stdout
        assert httpx2.get(page, timeout=30).text.startswith("<!doctype html>")
        assert demo.stop(timeout=90) == 0  # the API, then the three servers leave the swarm
    assert "Shutting the swarm down" in "".join(demo.stdout_lines)
