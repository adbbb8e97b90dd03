"""A local swarm inside the test process: the product's own bootstrap peer and ``Server`` objects, each
on an event loop in a thread of its own, talking over real p2p daemons on 127.0.0.1.

For tests that need a working swarm but not a process's life (signals, exit codes, memory, crashes):
an in-process server costs its p2p daemon and its blocks, not a Python start and a torch import.
``running_swarm`` (``petals.local_swarm``) starts real processes instead.

    with inprocess_swarm(model_dir, "0:2", "2:4") as (dht, servers):
        model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=dht.initial_peers, ...)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from petals.network.p2p import LOOPBACK_MADDRS, NetworkOptions

if TYPE_CHECKING:
    from petals.server.throughput import ThroughputInfo

READY_SECONDS = 180.0


class InProcessPeer:
    """A coroutine's life on a thread of its own: started, awaited ready, stopped by setting ``stop``."""

    name = "peer"

    def __init__(self) -> None:
        self.stop_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"petals-{self.name}", daemon=True)

    def start(self, timeout: float = READY_SECONDS, *, wait: bool = True) -> InProcessPeer:
        self._thread.start()
        return self.wait_ready(timeout) if wait else self

    def wait_ready(self, timeout: float = READY_SECONDS) -> InProcessPeer:
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(
                f"in-process {self.name} did not become ready within {timeout} s"
            ) from self._error
        return self

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self.stop_event is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # its loop has just ended
                self._loop.call_soon_threadsafe(self.stop_event.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"in-process {self.name} did not stop within {timeout} s")

    def __enter__(self) -> InProcessPeer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # reported by start() while starting; afterwards the peer just ends
            self._error = error
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self.stop_event = asyncio.get_running_loop(), asyncio.Event()
        await self.serve()

    async def serve(self) -> None:
        raise NotImplementedError

    def ready(self) -> None:
        self._ready.set()


class InProcessDht(InProcessPeer):
    """A bootstrap peer (what ``petals dht --loopback`` runs); ``initial_peers`` are its multiaddrs."""

    name = "dht"
    initial_peers: list[str]

    async def serve(self) -> None:
        from petals.dht import create_node
        from petals.network.p2p import leave_network
        from petals.reachability import ReachabilityProtocol

        network = NetworkOptions(
            host_maddrs=LOOPBACK_MADDRS, nat_port_map=False, auto_nat=False, use_relay=False
        )
        p2p = await network.create_p2p()
        node = None
        try:
            node = await create_node(p2p, ())
            await ReachabilityProtocol(p2p).add_p2p_handlers(p2p)
            self.initial_peers = [str(maddr) for maddr in await p2p.get_visible_maddrs()]
            self.ready()
            await self.stop_event.wait()
        finally:
            await leave_network(p2p, node)


class InProcessServer(InProcessPeer):
    """``petals serve MODEL --loopback --initial_peers ... ARGS`` as a ``Server`` in this process."""

    name = "server"

    def __init__(
        self,
        model: str | Path,
        initial_peers: Sequence[str],
        *args: str,
        throughput: ThroughputInfo | None = None,
    ) -> None:
        """``throughput``: announce these numbers (``forward_rps``, ``inference_rps`` too), measuring nothing."""
        from petals.cli.run_server import settings_from_argv
        from petals.server.server import Server

        super().__init__()
        peers = [item for peer in initial_peers for item in ("--initial_peers", peer)]
        if throughput is not None:
            args = (*args, "--throughput", str(throughput.throughput))
        settings = settings_from_argv([str(model), "--loopback", *peers, *args])
        if throughput is not None:
            settings = dataclasses.replace(settings, throughput=throughput)
        self.server = Server(settings)
        self.peer_id: str | None = None

    async def serve(self) -> None:
        server = self.server
        server.stop = self.stop_event
        serving = asyncio.create_task(server.run())
        online = asyncio.create_task(server.online.wait())
        await asyncio.wait({serving, online}, return_when=asyncio.FIRST_COMPLETED)
        if online.done():
            self.peer_id = str(server.peer_id)
            self.ready()
        else:
            online.cancel()
        await serving


@contextlib.contextmanager
def inprocess_swarm(
    model_path: str | Path, *block_ranges: str, server_args: Sequence[str] = ()
) -> Iterator[tuple[InProcessDht, list[InProcessServer]]]:
    """A bootstrap peer and one float32 server per ``"start:end"`` range, all ONLINE; stopped on exit."""
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        servers = [
            stack.enter_context(
                InProcessServer(
                    model_path,
                    dht.initial_peers,
                    "--block_indices",
                    blocks,
                    "--torch_dtype",
                    "float32",
                    *server_args,
                ).start(wait=False)
            )
            for blocks in block_ranges
        ]
        for server in servers:  # they load in parallel
            server.wait_ready()
        yield dht, servers
