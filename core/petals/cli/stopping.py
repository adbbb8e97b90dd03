"""How ``petals serve`` and ``petals dht`` stop on SIGINT/SIGTERM, whether sent to the pid or the process group.

The first signal asks for a clean exit: leave the swarm (a server announces OFFLINE), stop p2pd,
exit 0. That takes a few seconds at most, since every step has a deadline; should anything still
run ``GRACE_SECONDS`` after the signal, the process exits 0 anyway, saying so. A second signal
exits at once with 128 + its number (130 for SIGINT, 143 for SIGTERM), as a shell reports a
process killed by that signal. p2pd is killed first on both forced paths, so it never outlives us.

Python-level handlers (``signal.signal``), not the event loop's: they run even while the loop's
thread is blocked (joining the compute thread, waiting for a block still loading).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

from petals.network.p2p import kill_daemons

logger = logging.getLogger(__name__)

GRACE_SECONDS = 4.5  # a clean exit must finish within 5 s of the signal; exiting takes the rest
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT/SIGTERM handlers that set ``stop`` on the first signal and exit at once on the second."""

    def __init__(self, stop: asyncio.Event, grace: float = GRACE_SECONDS) -> None:
        self.stop, self.grace = stop, grace
        self.received: signal.Signals | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        """Call from the running event loop (``stop`` is set in it)."""
        self._loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        received = signal.Signals(signum)
        if self.received is not None:
            exit_now(128 + signum, f"Received {received.name} again: exiting at once")
        self.received = received
        logger.info("Received %s: shutting down (send it again to exit at once)", received.name)
        try:
            self._loop.call_soon_threadsafe(self.stop.set)
        except RuntimeError:  # the loop is closed: everything is stopped already
            exit_without_teardown(0)
        backstop = threading.Timer(self.grace, self._give_up, args=(time.monotonic(),))
        backstop.daemon = True
        backstop.start()

    def _give_up(self, since: float) -> None:
        exit_now(
            0,
            f"Still shutting down {time.monotonic() - since:.1f} s after {self.received.name}; "
            "exiting without waiting for the rest",
        )


def exit_now(code: int, message: str) -> NoReturn:
    """Log ``message``, kill our p2pd daemons and leave the process without any cleanup."""
    logger.warning(message)
    kill_daemons()
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit once everything is stopped, skipping the interpreter's teardown.

    Tearing down a server's hundreds of thousands of long-lived objects (torch, transformers) runs the
    cyclic GC over them, which can take seconds on a busy machine (``tests/test_server_signals.py``
    holds a stop to 5 s); there is nothing left that needs it.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
