"""A user-space TCP proxy on 127.0.0.1 that delays every chunk by a fixed time in each direction.

It turns a loopback swarm into a wide-area one: a server listens on a private port and announces
the proxy's port, so every peer (clients and other servers pushing to it) reaches it only through
the proxy and pays ``delay_ms`` per direction, as over a link with that one-way latency.

    with DelayProxy(target_port=private_port, delay_ms=20) as proxy:
        ...  # connect to 127.0.0.1:proxy.port

``start_server_behind_proxy`` starts a ``petals serve`` wired up that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from petals.testing.swarm import ServerProcess

CHUNK_BYTES = 64 * 1024
# chunks held per direction before the reader stops reading (TCP backpressure bounds memory)
MAX_CHUNKS_IN_FLIGHT = 256


@dataclass(frozen=True)
class ChunkEvent:
    """One chunk through a ``DelayProxy``: when it arrived, was due and was written (``time.monotonic()``)."""

    arrived: float
    due: float
    sent: float
    direction: str  # "to server" or "from server"
    size: int


class DelayProxy:
    """Forward ``127.0.0.1:.port`` to ``host:target_port``, holding each chunk ``delay_ms``.

    Each chunk is held from its own arrival (a stream of chunks is delayed, not slowed down), in
    order, in both directions. The asyncio loop runs in a daemon thread; ``close()`` (or leaving
    the ``with`` block) closes every socket. ``bytes_forwarded`` counts the payload both ways, so
    a caller can check that traffic really goes through the proxy; ``chunks_sent`` and
    ``late_seconds`` (the sum over chunks of how long after its due time each was written: timer
    granularity and waiting for the loop's thread) measure the proxy's own delay beyond ``delay_ms``.
    Assigning a list to ``events`` records every chunk written from then on as a ``ChunkEvent``.
    """

    def __init__(self, target_port: int, delay_ms: float = 20.0, host: str = "127.0.0.1") -> None:
        self.target_port = target_port
        self.delay_ms = delay_ms
        self.host = host
        self.port: int | None = None
        self.bytes_forwarded = 0
        self.chunks_sent = 0
        self.late_seconds = 0.0
        self.events: list[ChunkEvent] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> DelayProxy:
        if self._thread is not None:
            raise RuntimeError("DelayProxy is already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="DelayProxy", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop
        ).result()
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        if self._thread is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop may already be stopped
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._thread = None

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def _shutdown(self) -> None:
        """Stop accepting, then end every other task of this proxy's loop (a connection just accepted,
        a link's two directions, their senders): one left pending when the loop closes raises later,
        from the garbage collector."""
        self._server.close()
        this = asyncio.current_task()
        while others := asyncio.all_tasks() - {this}:
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)
        target_writer, directions = None, []
        try:
            target_reader, target_writer = await asyncio.open_connection(self.host, self.target_port)
            self._writers.add(target_writer)
            for sock_writer in (client_writer, target_writer):
                sock = sock_writer.get_extra_info("socket")
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            directions = [
                asyncio.create_task(self._pipe(client_reader, target_writer, "to server")),
                asyncio.create_task(self._pipe(target_reader, client_writer, "from server")),
            ]
            await asyncio.gather(*directions)
        except (OSError, asyncio.IncompleteReadError):
            pass  # a peer went away: the other side is closed below, as a real link would drop
        finally:
            for direction in directions:  # when one direction failed, the other ends with it
                direction.cancel()
            if directions:
                await asyncio.wait(directions)
            for writer in (client_writer, target_writer):
                if writer is not None:
                    writer.close()
                    self._writers.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Read chunks as they come; a second task writes each one ``delay_ms`` after it arrived."""
        held: asyncio.Queue[tuple[float, float, bytes]] = asyncio.Queue(MAX_CHUNKS_IN_FLIGHT)
        sender = asyncio.create_task(self._send_when_due(held, writer, direction))
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                arrived = time.monotonic()
                await held.put((arrived, arrived + self.delay_ms / 1000, chunk))
            arrived = time.monotonic()
            await held.put((arrived, arrived + self.delay_ms / 1000, b""))  # EOF, delayed like data
            await sender
        finally:
            sender.cancel()
            await asyncio.wait({sender})  # a task left pending when the loop closes is an error at exit

    async def _send_when_due(
        self, held: asyncio.Queue[tuple[float, float, bytes]], writer: asyncio.StreamWriter, direction: str
    ) -> None:
        while True:
            arrived, due, chunk = await held.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            sent = time.monotonic()
            self.late_seconds += max(0.0, sent - due)
            if self.events is not None:
                self.events.append(ChunkEvent(arrived, due, sent, direction, len(chunk)))
            writer.write(chunk)
            self.chunks_sent += 1
            self.bytes_forwarded += len(chunk)
            await writer.drain()


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def start_server_behind_proxy(
    model: str | Path,
    initial_peers: Sequence[str],
    *args: str,
    delay_ms: float = 20.0,
    **kwargs,
) -> Iterator[tuple[ServerProcess, DelayProxy]]:
    """A ``petals serve`` that listens on a private port and announces a ``DelayProxy`` in front of it.

    Everyone who finds the server through the DHT connects to the proxy, so each message to or from
    it is held ``delay_ms`` per direction. Extra arguments go to ``petals.testing.swarm.start_server``.
    """
    from petals.testing.swarm import start_server

    private_port = free_local_port()
    with DelayProxy(private_port, delay_ms) as proxy:
        maddrs = (
            "--host_maddrs",
            f"/ip4/127.0.0.1/tcp/{private_port}",
            "--announce_maddrs",
            f"/ip4/127.0.0.1/tcp/{proxy.port}",
        )
        with start_server(model, initial_peers, *maddrs, *args, **kwargs) as server:
            yield server, proxy
