"""``petals api`` against hostile and unlucky clients: every answer is a clear 4xx/5xx in OpenAI's shape,
other web pages cannot drive it, a stalled server never disables it, and the process stays up.

A real ``petals api`` process (with an API key and one allowed foreign origin) in front of a real swarm
of the tiny chat Llama of ``test_api``; a second swarm whose only server is a process this module stops
(SIGSTOP) and resumes. Clients are httpx, the ``websockets`` client and, for the page, headless Chromium.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest
from test_api import MODEL_ID, model_path, tokenizer  # noqa: F401  (the module's own copies of these fixtures)
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from conftest import inprocess_swarm, launch_chromium, swarm_with_processes
from petals.api.errors import generation_error
from petals.client.routing import RouteBanned
from petals.testing.swarm import start_api

KEY = "k1"
FOREIGN_PAGE = "http://chat.example.org"  # --allow_origin
AUTH = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(model_path):  # noqa: F811
    with inprocess_swarm(model_path, "0:4") as (dht, _):
        args = ("--api_key", KEY, "--allow_origin", FOREIGN_PAGE, "--max_tokens", "64")
        with start_api(model_path, dht.initial_peers, *args) as process:
            yield process


@pytest.fixture(scope="module")
def http(api) -> httpx2.Client:
    with httpx2.Client(base_url=api.url, headers=AUTH, timeout=60) as client:
        yield client


def ws_url(api) -> str:
    return api.url.replace("http", "ws", 1) + "/api/v2/generate"


def assert_openai_error(response, status: int) -> dict:
    """``response`` is a ``status`` in OpenAI's error shape, with no traceback or path in it."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "code"} and body["error"]["message"], body
    assert_no_internals(response.text)
    return body["error"]


def assert_no_internals(text: str) -> None:
    assert "Traceback" not in text and not re.search(r"/[\w.-]+/[\w./-]+\.py", text), text
    for python_error in ("KeyError", "TypeError", "IndexError", "OverflowError", "AttributeError"):
        assert python_error not in text, text


VALID = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


# ---- values out of range and loose types: 400 naming the field ----------------------------------------


@pytest.mark.parametrize(
    "change, param",
    [
        ({"seed": 2**70, "temperature": 1}, "seed"),
        ({"max_tokens": "3"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": 1e308}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 1000}, "stop"),
        ({"prompt": [[2**70]]}, "prompt"),
    ],
    ids=[
        "seed 2**70",
        "max_tokens '3'",
        "stream 'yes'",
        "temperature 1e308",
        "5 stops",
        "long stop",
        "huge id",
    ],
)
def test_bounded_and_typed_values_are_refused_with_400(http, change, param):
    error = assert_openai_error(http.post("/v1/completions", json={**VALID, **change}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"model": "x", "prompt": "a", "temperature": NaN}', b"[]", b'"text"', b"\xff\xfe"],
    ids=["broken", "NaN", "array", "string", "not utf-8"],
)
def test_bodies_that_are_no_request_are_400_without_a_byte_offset_as_param(http, content):
    response = http.post(
        "/v1/chat/completions", content=content, headers={"Content-Type": "application/json"}
    )
    error = assert_openai_error(response, 400)
    assert error["param"] is None or not error["param"].isdigit()


@pytest.mark.parametrize(
    "method, path, status, code",
    [
        ("GET", "/no/such/route", 404, "not_found"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ("POST", "/v1/embeddings", 404, "not_found"),
    ],
)
def test_unknown_routes_and_methods_answer_in_openai_shape(http, method, path, status, code):
    assert assert_openai_error(http.request(method, path), status)["code"] == code


def test_tokenizing_long_prompts_does_not_stall_other_requests(http):
    """Four long prompts are tokenized off the event loop: ``/v1/models`` answers before they are done
    (on the loop, it waited for all four)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 11_000  # 495,000 characters each
    done: list[str] = []

    def long_request(_) -> None:
        response = http.post("/v1/completions", json={**VALID, "prompt": prompt})
        assert_openai_error(response, 400)  # beyond the context: refused once tokenized
        done.append("long")

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long_request, index) for index in range(4)]
        time.sleep(0.2)  # the requests have arrived
        assert http.get("/v1/models").status_code == 200
        done.append("models")
        for future in futures:
            future.result()
    assert done.index("models") < 4, done


# ---- other web pages: Host and Origin --------------------------------------------------------------------


def test_a_host_name_that_is_not_ours_is_refused(api, http):
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 is refused by name."""
    port = api.url.rsplit(":", 1)[1]
    for path in ("/", "/v1/models"):
        error = assert_openai_error(http.get(path, headers={"Host": f"evil.example:{port}"}), 403)
        assert error["code"] == "host_not_allowed"
    assert http.get("/v1/models", headers={"Host": f"localhost:{port}"}).status_code == 200


def test_form_posts_and_websockets_from_other_pages_are_refused(api, http):
    form = {"inputs": "Hi", "max_new_tokens": "1"}
    refused = http.post("/api/v1/generate", data=form, headers={"Origin": "http://evil.example"})
    assert assert_openai_error(refused, 403)["code"] == "origin_not_allowed"
    for origin in ("http://evil.example", "null"):
        with pytest.raises(InvalidStatus) as handshake:
            connect(ws_url(api), origin=origin, additional_headers=AUTH, open_timeout=30)
        assert handshake.value.response.status_code == 403
    # the API's own pages and the allowed one are served
    assert http.post("/api/v1/generate", data=form, headers={"Origin": api.url}).json()["ok"] is True
    with connect(ws_url(api), origin=FOREIGN_PAGE, additional_headers=AUTH, open_timeout=30) as websocket:
        websocket.send(json.dumps({"type": "open_inference_session", "max_length": 8}))
        assert json.loads(websocket.recv(timeout=60)) == {"ok": True}


# ---- the API key on a WebSocket: in the first message ------------------------------------------------------


@pytest.mark.parametrize("given", [None, "wrong"])
def test_a_websocket_without_the_key_is_closed_after_its_first_message(api, given):
    with connect(ws_url(api), origin=api.url, open_timeout=30) as websocket:
        opening = {"type": "open_inference_session", "max_length": 8}
        websocket.send(json.dumps(opening if given is None else {**opening, "api_key": given}))
        reply = json.loads(websocket.recv(timeout=60))
    assert reply["ok"] is False and reply["error"]["code"] == "invalid_api_key"


def test_a_websocket_may_send_the_key_in_its_first_message(api):
    with connect(ws_url(api), origin=api.url, open_timeout=30) as websocket:
        websocket.send(json.dumps({"type": "open_inference_session", "max_length": 16, "api_key": KEY}))
        assert json.loads(websocket.recv(timeout=60)) == {"ok": True}
        websocket.send(json.dumps({"type": "generate", "inputs": "Hi", "max_new_tokens": 2}))
        reply = json.loads(websocket.recv(timeout=60))
    assert reply["ok"] is True and reply["token_count"] == 2


def test_the_page_uses_a_keyed_api_and_its_websocket(api):
    """In Chromium: the chat page asks for the key and answers with it; a WebSocket of the page's origin
    sends the key in its first message (a browser cannot set the Authorization header)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page()
            page.goto(api.url)
            page.wait_for_selector("#key-row", state="visible", timeout=30_000)  # the API answered 401
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            page.wait_for_function(f"document.getElementById('model').textContent === '{MODEL_ID}'")
            page.fill("#question", "Hi")
            page.keyboard.press("Enter")
            page.wait_for_selector(".assistant.done", timeout=60_000)
            assert page.query_selector(".error") is None
            reply = page.evaluate(
                """key => new Promise((resolve, reject) => {
                    const socket = new WebSocket(location.origin.replace("http", "ws") + "/api/v2/generate");
                    const replies = [];
                    socket.onopen = () => socket.send(JSON.stringify(
                        {type: "open_inference_session", max_length: 16, api_key: key}));
                    socket.onmessage = event => {
                        replies.push(JSON.parse(event.data));
                        if (replies.length === 1)
                            socket.send(JSON.stringify({type: "generate", inputs: "Hi", max_new_tokens: 2}));
                        else { socket.close(); resolve(replies); }
                    };
                    socket.onerror = () => reject(new Error("the WebSocket failed"));
                })""",
                KEY,
            )
            assert reply[0] == {"ok": True} and reply[1]["ok"] is True and reply[1]["token_count"] == 2
        finally:
            browser.close()


# ---- the Petals chat API's values ---------------------------------------------------------------------------

OPEN = {"type": "open_inference_session", "max_length": 64, "api_key": KEY}
TURN = {"type": "generate", "inputs": "Hi", "max_new_tokens": 2}


@pytest.mark.parametrize(
    "first_turn",
    [
        b"\x00binary frame",
        {**TURN, "stop_sequence": 5},
        {"type": "generate", "max_new_tokens": 2},
        '{"type": "generate", "inputs": "Hi", "max_new_tokens": 1e400}',
        '{"type": "generate", "inputs": "Hi", "max_new_tokens": 2, "do_sample": 1, "temperature": NaN}',
        {**TURN, "max_new_tokens": 2.5},
        {**TURN, "stop_sequence": "</s>", "extra_stop_sequences": ["x"] * 10_000},
        {**TURN, "stop_sequence": "x" * 1000},
    ],
    ids=["binary", "stop 5", "no inputs", "1e400", "NaN", "2.5 tokens", "10,000 stops", "long stop"],
)
def test_chat_api_values_are_refused_with_a_clear_error(api, first_turn):
    with connect(ws_url(api), origin=api.url, open_timeout=30) as websocket:
        websocket.send(json.dumps(OPEN))
        assert json.loads(websocket.recv(timeout=60)) == {"ok": True}
        websocket.send(first_turn if isinstance(first_turn, bytes | str) else json.dumps(first_turn))
        text = websocket.recv(timeout=60)
    reply = json.loads(text)
    assert reply["ok"] is False and reply["traceback"] == reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    assert_no_internals(text)


@pytest.mark.parametrize(
    "content, content_type",
    [
        (b"inputs=Hi", "application/x-www-form-urlencoded"),
        (b"inputs=Hi&max_new_tokens=1e400", "application/x-www-form-urlencoded"),
        (b"max_new_tokens=2", "application/x-www-form-urlencoded"),
        (b"--x\r\ngarbage", "multipart/form-data; boundary=x"),
        (b'{"inputs": "Hi", "max_new_tokens": 2', "application/json"),
    ],
    ids=["no max_new_tokens", "1e400", "no inputs", "broken multipart", "broken JSON"],
)
def test_http_generate_errors_keep_the_original_body_with_a_4xx_status(http, content, content_type):
    """The original answered ``{"ok": false, "traceback"}`` with a 200; its clients read that body, which
    stays, with OpenAI's ``error`` beside it and a 400."""
    response = http.post("/api/v1/generate", content=content, headers={"Content-Type": content_type})
    assert_openai_error(response, 400)
    assert response.json()["ok"] is False and response.json()["traceback"]


def test_idle_websocket_sessions_hold_no_generation_place(api, http):
    """64 open, idle WebSocket sessions (the most there may be): generations still run; a 65th session is
    refused as busy until one closes."""
    with contextlib.ExitStack() as sessions:
        for _ in range(64):
            websocket = sessions.enter_context(
                connect(ws_url(api), origin=api.url, additional_headers=AUTH, open_timeout=30)
            )
            websocket.send(json.dumps(OPEN))
            assert json.loads(websocket.recv(timeout=60)) == {"ok": True}
        assert http.post("/v1/completions", json=VALID).status_code == 200
        with connect(ws_url(api), origin=api.url, additional_headers=AUTH, open_timeout=30) as extra:
            extra.send(json.dumps(OPEN))
            refused = json.loads(extra.recv(timeout=60))
        assert refused["ok"] is False and refused["error"]["code"] == "server_busy"
    assert metric(http, "petals_api_websocket_sessions", until=0) == 0


def metric(http: httpx2.Client, name: str, until: float | None = None, timeout: float = 30) -> float:
    """A gauge of the API's ``/metrics``; with ``until``, read again until it has that value (or time is up)."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        value = float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))
        if until is None or value == until or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_the_api_survives_the_probes(api, http):
    assert api.process.poll() is None
    assert http.post("/v1/completions", json=VALID).json()["choices"][0]["finish_reason"] == "length"
    assert metric(http, "petals_api_requests_in_progress", until=0) == 0


def test_a_banned_route_is_a_503_with_retry_after():
    """The answer to a request whose every server of some blocks is banned (``RouteBanned``)."""
    error = generation_error(RouteBanned("every server of block x.0 is banned for now; retry in 12 s", 11.2))
    assert (error.status, error.code, error.headers) == (503, "swarm_missing_blocks", {"Retry-After": "12"})


# ---- a stall of the only server -----------------------------------------------------------------------------

STREAMS = 32
STALL = 8.0  # seconds the only server is stopped (SIGSTOP, then SIGCONT)


@pytest.fixture(scope="module")
def stoppable(model_path):  # noqa: F811
    """The only server of every block, a process this module stops; a keyless API in front of it."""
    with swarm_with_processes(model_path, "0:4", processes=1) as (dht, (server,)):
        with start_api(model_path, dht.initial_peers, "--max_tokens", "64") as api_process:
            with httpx2.Client(base_url=api_process.url, timeout=120) as client:
                yield server, api_process, client


class _Stream(threading.Thread):
    """One streamed completion, read to its end: how many text events, and how it ended."""

    def __init__(self, url: str, index: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.index, self.max_tokens = url, index, max_tokens
        self.tokens, self.ended, self.first_token = 0, "unfinished", threading.Event()

    def run(self) -> None:
        body = {**VALID, "prompt": f"Story {self.index}:", "max_tokens": self.max_tokens, "stream": True}
        try:
            with httpx2.stream("POST", f"{self.url}/v1/completions", json=body, timeout=180) as response:
                if response.status_code != 200:
                    self.ended = f"status {response.status_code}"
                    return
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.ended = "done"
                    elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                        self.ended = "error event"
                    elif line.startswith("data: "):
                        self.tokens += 1
                        self.first_token.set()
        except httpx2.HTTPError as error:
            self.ended = f"broken: {error}"
        finally:
            self.first_token.set()


def test_a_stall_of_the_only_server_never_disables_the_api(stoppable):
    """The only server stops for 8 s during 32 streams: every stream ends (with its tokens or an error
    event) and a new request is answered within 30 s of the server's return."""
    server, api_process, client = stoppable
    streams = [_Stream(api_process.url, index, max_tokens=64) for index in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(120)
    server.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(STALL)
    finally:
        server.process.send_signal(signal.SIGCONT)
    returned = time.monotonic()
    while (response := client.post("/v1/completions", json=VALID, timeout=30)).status_code != 200:
        assert time.monotonic() - returned < 30, (
            f"no answer within 30 s of the server's return: {response.text}"
        )
        time.sleep(1)
    assert time.monotonic() - returned < 30
    for stream in streams:
        stream.join(180)
    assert all(stream.ended in ("done", "error event") for stream in streams), [s.ended for s in streams]
    assert api_process.process.poll() is None


def test_clients_that_leave_while_the_server_is_stopped_free_their_places(stoppable):
    """Requests that wait for a stopped server are cancelled when their clients leave: their places are
    free again at once, not after the 180 s the only server of its blocks is waited for."""
    server, api_process, client = stoppable
    server.process.send_signal(signal.SIGSTOP)
    try:
        leaving = [
            post_without_reading(api_process.url, {**VALID, "stream": stream}) for stream in (True, False) * 4
        ]
        log = api_process.stdout_lines
        assert metric(client, "petals_api_requests_in_progress", until=8) == 8, log[-20:]
        for connection in leaving:
            connection.close()
        assert metric(client, "petals_api_requests_in_progress", until=0) == 0, log[-20:]
    finally:
        server.process.send_signal(signal.SIGCONT)
    response = client.post("/v1/completions", json=VALID)
    assert response.status_code == 200, response.text


def post_without_reading(url: str, body: dict) -> socket.socket:
    """A client that sends ``POST /v1/completions`` and waits for nothing (a socket it may close)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    connection = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    connection.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection
