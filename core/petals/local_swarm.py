"""Start a real local swarm: ``petals dht`` and ``petals serve`` subprocesses on 127.0.0.1.

``petals demo`` runs on it; tests reach it through ``petals.testing.swarm``.

Every process runs with ``--loopback`` (listen on 127.0.0.1, no NAT port mapping, no AutoNAT, no
relays), so nothing leaves the machine. Processes are stopped through their own handles (SIGINT,
then SIGKILL after a timeout), never by matching names; the unix sockets a killed process and its p2p
daemon leave in /tmp are removed. ``own_process_group=True`` starts one in a
new session, as its own process group (pgid == pid), for tests that signal the whole group.

    with start_dht() as dht, start_server(model_dir, dht.initial_peers, "--block_indices", "0:2") as server:
        ...
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from petals.server.server import READY_MESSAGE

PEER_ID_PATTERN = re.compile(r"Joined the swarm in [\d.]+ s as (\S+)")


class SwarmProcessError(RuntimeError):
    """A swarm process exited or did not become ready in time; the message holds its log."""


class SwarmProcess:
    """A running ``petals`` subprocess whose stderr (the log) is collected line by line."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        own_process_group: bool = False,
    ) -> None:
        self.name = name
        self.started_at = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=own_process_group,
        )
        self.own_process_group = own_process_group
        self._sockets: set[str] = set()  # hivemind's unix sockets of this process and its p2p daemon
        self.stdout_lines: list[str] = []
        self.log_lines: list[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(
                target=self._collect, args=(self.process.stdout, self.stdout_lines), daemon=True
            ),
            threading.Thread(target=self._collect, args=(self.process.stderr, self.log_lines), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log(self) -> str:
        return "".join(self.log_lines)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the process group this process leads (``own_process_group=True`` only)."""
        if not self.own_process_group or os.getpgid(self.pid) != self.pid:
            raise SwarmProcessError(f"{self.name} does not lead a process group of its own")
        os.killpg(self.pid, signum)

    def _collect(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._changed:
                lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, predicate, timeout: float, what: str):
        """Wait until ``predicate()`` returns something truthy; fail with the log if the process dies."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = predicate()
                if result:
                    if not self._sockets:  # once: ``peer_id`` may be read often
                        self._note_sockets()
                    return result
                if self.process.poll() is not None and not any(reader.is_alive() for reader in self._readers):
                    raise SwarmProcessError(
                        f"{self.name} exited with {self.process.returncode} before {what}:\n{self.log}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SwarmProcessError(f"{self.name}: no {what} within {timeout} s:\n{self.log}")
                self._changed.wait(min(left, 0.5))

    def wait_for_log(self, text: str, timeout: float = 30) -> str:
        return self.wait_for(
            lambda: next((line for line in self.log_lines if text in line), None), timeout, repr(text)
        )

    def _note_sockets(self) -> None:
        """Remember the unix sockets hivemind made for this process and its p2p daemon (in /tmp): a process
        killed with SIGKILL, or a daemon killed under it, cannot remove its own."""
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(self.pid)
            for member in [process, *process.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    for connection in member.net_connections(kind="unix"):
                        if isinstance(connection.laddr, str) and "/hivemind-" in connection.laddr:
                            self._sockets.add(connection.laddr)

    def _remove_sockets(self) -> None:
        for path in self._sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def stop(self, timeout: float = 15) -> int:
        """SIGINT, then SIGKILL if it has not exited within ``timeout`` s; returns the exit code. Removes
        the sockets it leaves behind."""
        if self.process.poll() is None:
            self._note_sockets()
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        self._remove_sockets()
        return self.process.returncode

    def __enter__(self) -> SwarmProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class DhtProcess(SwarmProcess):
    initial_peers: list[str]

    def wait_ready(self, timeout: float = 30) -> None:
        """Wait until it has printed its multiaddrs (then in ``.initial_peers``)."""
        self.wait_for(lambda: self.stdout_lines, timeout, "printed multiaddrs")
        time.sleep(0.05)  # let the remaining lines of the same write arrive
        self.initial_peers = [line.strip() for line in self.stdout_lines if line.startswith("/")]


class ServerProcess(SwarmProcess):
    ready_seconds: float
    timeout: float = 120  # how long ``peer_id`` waits for the line saying it joined

    @property
    def peer_id(self) -> str:
        """Its peer id, from the log line saying it joined the swarm (waiting for that line)."""
        joined = self.wait_for_log("Joined the swarm", self.timeout)
        return PEER_ID_PATTERN.search(joined).group(1)


class ApiProcess(SwarmProcess):
    url: str  # http://127.0.0.1:PORT

    def wait_ready(self, timeout: float = 120) -> ApiProcess:
        """Wait for the line saying where it serves; sets ``url``."""
        from petals.cli.api import READY_MESSAGE

        try:
            line = self.wait_for(
                lambda: next((line for line in self.stdout_lines if READY_MESSAGE in line), None),
                timeout,
                "its ready line",
            )
        except BaseException:
            self.stop()
            raise
        self.url = re.search(r" at (http://\S+) ", line).group(1)
        return self


def start_dht(
    *args: str, timeout: float = 90, wait_ready: bool = True, own_process_group: bool = False
) -> DhtProcess:
    """A bootstrap peer; ``.initial_peers`` holds the multiaddrs it printed (once ready)."""
    process = DhtProcess(
        "petals dht", ["petals.cli.run_dht", "--loopback", *args], own_process_group=own_process_group
    )
    if wait_ready:
        try:
            process.wait_ready(timeout)
        except BaseException:
            process.stop()
            raise
    return process


def start_server(
    model: str | Path,
    initial_peers: Sequence[str],
    *args: str,
    timeout: float = 120,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    own_process_group: bool = False,
    wait_joined: bool = True,
) -> ServerProcess:
    """``petals serve MODEL --loopback --initial_peers ...``, by default waiting until it is ONLINE.

    ``wait_ready=False`` returns once it has joined the swarm (its peer id known) and
    ``wait_joined=False`` at once, so that servers started one after another import and load together.
    """
    peers = [item for peer in initial_peers for item in ("--initial_peers", peer)]
    command = ["petals.cli.run_server", str(model), "--loopback", *peers, *args]
    name = f"petals serve {Path(str(model)).name} {' '.join(args)}"
    process = ServerProcess(name, command, env, own_process_group)
    process.timeout = timeout
    try:
        if wait_joined or wait_ready:
            process.wait_for_log("Joined the swarm", timeout)
        if wait_ready:
            process.wait_for_log(READY_MESSAGE, timeout)
            process.ready_seconds = time.perf_counter() - process.started_at
    except BaseException:
        process.stop()
        raise
    return process


def start_api(
    model: str | Path, initial_peers: Sequence[str], *args: str, timeout: float = 120, wait_ready: bool = True
) -> ApiProcess:
    """``petals api MODEL --loopback --port 0 --initial_peers ...``, by default waiting until it serves."""
    peers = [item for peer in initial_peers for item in ("--initial_peers", peer)]
    command = ["petals.cli", "api", str(model), "--loopback", "--port", "0", *peers, *args]
    process = ApiProcess(f"petals api {Path(str(model)).name}", command)
    return process.wait_ready(timeout) if wait_ready else process


@contextlib.contextmanager
def running_swarm(
    model_path: str | Path,
    *block_ranges: str,
    server_args: Sequence[str] = (),
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[DhtProcess, list[ServerProcess]]]:
    """A ``petals dht`` and one float32 ``petals serve`` per ``"start:end"`` range, all ONLINE.

    The servers start together, so they load in parallel; everything stops on exit.
    """
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(start_dht())
        servers = [
            stack.enter_context(
                start_server(
                    model_path,
                    dht.initial_peers,
                    "--block_indices",
                    blocks,
                    "--torch_dtype",
                    "float32",
                    *server_args,
                    wait_ready=False,
                    wait_joined=False,
                    timeout=timeout,
                    env=env,
                )
            )
            for blocks in block_ranges
        ]
        for server in servers:
            server.wait_for_log(READY_MESSAGE, timeout=timeout)
        yield dht, servers


class MonitorProcess(SwarmProcess):
    url: str


MONITOR_URL_PATTERN = re.compile(r"Monitor: (http://\S+/)")


def start_monitor(initial_peers: Sequence[str], *args: str, timeout: float = 60) -> MonitorProcess:
    """``petals monitor --loopback --port 0 --initial_peers ...``; ``.url`` is the page it serves."""
    peers = [item for peer in initial_peers for item in ("--initial_peers", peer)]
    process = MonitorProcess(
        "petals monitor", ["petals.cli.monitor", "--loopback", "--port", "0", *peers, *args]
    )
    try:
        line = process.wait_for(
            lambda: next((line for line in process.stdout_lines if MONITOR_URL_PATTERN.search(line)), None),
            timeout,
            "printed its address",
        )
        process.url = MONITOR_URL_PATTERN.search(line).group(1)
    except BaseException:
        process.stop()
        raise
    return process
