"""DelayProxy: bytes pass unchanged, each direction is held delay_ms, sockets close on exit."""

from __future__ import annotations

import gc
import os
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import petals
from petals.testing.delay_proxy import DelayProxy, start_server_behind_proxy
from petals.testing.swarm import LOOPBACK_CLIENT, InProcessDht

DELAY_MS = 30.0


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server.server_address[1]
        server.shutdown()


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    received = bytearray()
    while len(received) < size:
        chunk = sock.recv(size - len(received))
        assert chunk, "the proxy closed the connection early"
        received += chunk
    return bytes(received)


def test_bytes_pass_through_unchanged_in_order(echo_port):
    payload = os.urandom(1_000_000)
    with (
        DelayProxy(echo_port, delay_ms=1) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as sock,
    ):
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        assert receive_exactly(sock, len(payload)) == payload
        sender.join()
    assert proxy.bytes_forwarded == 2 * len(payload)


def test_the_proxy_records_each_chunk_and_how_late_it_was_written(echo_port):
    with (
        DelayProxy(echo_port, delay_ms=DELAY_MS) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as sock,
    ):
        sock.sendall(b"before")
        receive_exactly(sock, 6)
        proxy.events = events = []
        for message in (b"one", b"three"):
            sock.sendall(message)
            assert receive_exactly(sock, len(message)) == message
        proxy.events = None
        sock.sendall(b"after")
        receive_exactly(sock, 5)
    assert [(event.direction, event.size) for event in events] == [
        ("to server", 3),
        ("from server", 3),
        ("to server", 5),
        ("from server", 5),
    ]
    for event in events:
        assert event.due == pytest.approx(event.arrived + DELAY_MS / 1000)
        assert event.sent >= event.due
    assert proxy.chunks_sent == 8
    assert proxy.late_seconds >= sum(event.sent - event.due for event in events)


def test_a_round_trip_takes_twice_the_delay_and_delays_do_not_add_up(echo_port):
    with (
        DelayProxy(echo_port, delay_ms=DELAY_MS) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as sock,
    ):
        round_trips = []
        for index in range(3):
            message = f"ping {index}".encode()
            started = time.perf_counter()
            sock.sendall(message)
            assert receive_exactly(sock, len(message)) == message
            round_trips.append(time.perf_counter() - started)
        assert min(round_trips) >= 2 * DELAY_MS / 1000

        # 5 messages sent back to back come back about one round trip later, not five
        started = time.perf_counter()
        for _ in range(5):
            sock.sendall(b"x")
            time.sleep(0.005)
        receive_exactly(sock, 5)
        assert time.perf_counter() - started < 5 * 2 * DELAY_MS / 1000


def test_closing_the_proxy_closes_open_connections(echo_port):
    proxy = DelayProxy(echo_port, delay_ms=1).start()
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    sock.sendall(b"hello")
    assert receive_exactly(sock, 5) == b"hello"
    proxy.close()
    sock.settimeout(5)
    assert sock.recv(10) == b""  # the proxy's end is closed, not left hanging
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()


def test_a_proxy_closed_while_a_dropped_link_drains_leaves_no_task_behind(monkeypatch):
    """The target resets the connection: one direction of the link fails while the other still holds
    the end of its stream for the delay. Closing the proxy then must finish that direction too: a task
    left pending when the proxy's loop closes raises later, from the garbage collector (CI saw it)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with socket.create_server(("127.0.0.1", 0)) as target:
        proxy = DelayProxy(target.getsockname()[1], delay_ms=2_000).start()
        with socket.create_connection(("127.0.0.1", proxy.port)):
            accepted, _ = target.accept()
            accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            accepted.close()  # a reset, not an orderly close
            time.sleep(0.3)  # the proxy reads the reset; the other direction now waits out its delay
            proxy.close()
    gc.collect()
    assert [hook.exc_value for hook in unraisable] == []


def test_a_server_behind_the_proxy_is_reached_through_it(tiny_model_path):
    path = tiny_model_path("llama")
    with (
        InProcessDht().start() as dht,
        start_server_behind_proxy(
            path, dht.initial_peers, "--block_indices", "0:4", "--torch_dtype", "float32", delay_ms=5
        ) as (server, proxy),
    ):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        try:
            before = proxy.bytes_forwarded
            ids = torch.tensor([[5, 6, 7]])
            assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 5)
            assert proxy.bytes_forwarded > before
            assert f"/tcp/{proxy.port}" in " ".join(server.log_lines)
        finally:
            model.close()
