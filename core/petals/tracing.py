"""Opt-in step tracing: where each inference step's time goes, in the client and in every server.

Set ``PETALS_TRACE=1`` in the environment of the client and of the servers you run. The client then
times every step of its inference sessions (embeddings, LM head and generate's own logic, its
thread hand-off, (de)serialization, the wait for each server), asks the servers for their timings
(the optional request metadata key ``"trace"``), and logs the means when a session closes.
A server started with ``PETALS_TRACE=1`` times the steps whose request asks for it (arrival to
compute queue, queue wait, compute per block, hand-back to the event loop, serialization, push)
and returns them under the optional response metadata key ``"server_trace"``; stock Petals peers never
send or read either key. Off (the default), nothing is timed: each step checks one global.

In code, ``with petals.tracing.collect() as steps:`` traces the sessions run inside it (whatever
the environment says) and leaves one dict of durations in seconds per step in ``steps``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator

logger = logging.getLogger(__name__)

TRACE_ENV = "PETALS_TRACE"
MAX_STEPS = 100_000  # steps kept by the environment-enabled collector (oldest dropped first)


def enabled_by_env() -> bool:
    return os.environ.get(TRACE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


SERVER_TRACING = enabled_by_env()  # a server answers "trace" requests only when started with it


class StepTrace:
    """Named durations (seconds) of one step, summed per name, in the order first recorded."""

    __slots__ = ("marks", "times")
    enabled = True

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.marks: dict[str, float] = {}  # moments (perf_counter) that other threads' timings refer to

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def mark(self, name: str) -> float:
        self.marks[name] = now = time.perf_counter()
        return now

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds

    def add_since(self, name: str, started: float) -> float:
        """Add the time since ``started`` (a ``time.perf_counter()``); return now."""
        now = time.perf_counter()
        self.add(name, now - started)
        return now

    def merge(self, prefix: str, times: dict[str, float]) -> None:
        for name, seconds in times.items():
            self.add(f"{prefix}{name}", seconds)

    def add_compute_queue(self) -> None:
        """A server step's wait for the compute thread, and its hand-back to the event loop (from its marks)."""
        marks = self.marks
        if "compute started" in marks:
            self.add("queue wait", marks["compute started"] - marks["queued"])
            self.add("hand-back to event loop", self.now() - marks["compute ended"])


def server_step_trace(arrived: float) -> StepTrace:
    """A server step's trace, begun as the step leaves its session's inbox (``arrived``: when it came, or 0)."""
    trace = StepTrace()
    dequeued = trace.mark("dequeued")
    trace.marks["arrived"] = arrived or dequeued
    trace.add("arrival to dequeue", dequeued - trace.marks["arrived"])
    return trace


class _NoTrace(StepTrace):
    """What an untraced step records: nothing, and no clock is read."""

    __slots__ = ()
    enabled = False

    @staticmethod
    def now() -> float:
        return 0.0

    def mark(self, name: str) -> float:
        return 0.0

    def add(self, name: str, seconds: float) -> None:
        pass

    def add_since(self, name: str, started: float) -> float:
        return 0.0

    def merge(self, prefix: str, times: dict[str, float]) -> None:
        pass

    def add_compute_queue(self) -> None:
        pass


NO_TRACE: StepTrace = _NoTrace()  # shared by every untraced step: it never holds anything


class StepLog:
    """The client steps traced in this process; ``pending`` collects what runs before a step starts."""

    def __init__(self, maxlen: int | None = None) -> None:
        self.steps: deque[dict[str, float]] = deque(maxlen=maxlen)
        self.pending = StepTrace()  # e.g. the embeddings of the step about to be sent

    def take_pending(self) -> StepTrace:
        pending, self.pending = self.pending, StepTrace()
        return pending


client_log: StepLog | None = StepLog(MAX_STEPS) if enabled_by_env() else None


@contextlib.contextmanager
def collect() -> Iterator[list[dict[str, float]]]:
    """Trace the client steps run inside this block; yields the list their durations go to."""
    global client_log
    previous, client_log = client_log, StepLog()
    steps: list[dict[str, float]] = []
    try:
        yield steps
    finally:
        steps.extend(client_log.steps)
        client_log = previous


def means(steps: Iterable[dict[str, float]]) -> dict[str, float]:
    """Mean seconds per name over the steps that recorded it, in first-recorded order.

    Means, not medians: the parts of a step then add up to its total (sums of medians do not).
    """
    values: dict[str, list[float]] = {}
    for step in steps:
        for name, seconds in step.items():
            values.setdefault(name, []).append(seconds)
    return {name: statistics.fmean(samples) for name, samples in values.items()}


def format_means(steps: list[dict[str, float]]) -> str:
    return ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in means(steps).items())


def log_session(steps: list[dict[str, float]]) -> None:
    if steps:
        logger.info("%s: mean per step over %d steps: %s", TRACE_ENV, len(steps), format_means(steps))
