"""One compute thread for all torch work, fed by a priority queue.

The event loop never runs torch: handlers ``await queue.run(priority, fn, ...)`` and the worker
thread runs tasks most-urgent-first (lower priority value first, then arrival order). A decode step
of one session is a single small task; a long prefill or a forward/backward pass is submitted one
block at a time, so other sessions' decode steps slip in between its blocks instead of waiting for
the whole pass. Tasks carry their kind and size, which is what a later batcher needs to merge
concurrent decode steps into one forward.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

logger = logging.getLogger(__name__)


class Priority(IntEnum):
    DECODE = 0  # short inference steps: one task for all blocks of the span
    PREFILL = 1  # long inference steps, one task per block
    FORWARD = 2  # rpc_forward / rpc_backward, one task per block


@dataclass(order=True)
class _Task:
    priority: int
    sequence: int
    tokens: int = field(compare=False)
    function: Callable[[], Any] = field(compare=False)
    future: asyncio.Future = field(compare=False)
    loop: asyncio.AbstractEventLoop = field(compare=False)


class ComputeQueue:
    """Runs submitted functions in one worker thread, most urgent first."""

    def __init__(self) -> None:
        self._tasks: queue.PriorityQueue[_Task | None] = queue.PriorityQueue()
        self._sequence = itertools.count()
        self._thread = threading.Thread(target=self._work, name="petals-compute", daemon=True)
        self.tokens_processed = 0
        self.busy_seconds = 0.0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._tasks.put(
            _Task(priority=1 << 30, sequence=1 << 62, tokens=0, function=None, future=None, loop=None)
        )
        self._thread.join(timeout=30)

    async def run(self, priority: Priority, tokens: int, function: Callable[[], Any]) -> Any:
        """Run ``function()`` in the compute thread and return its result (or raise its exception)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._tasks.put(_Task(int(priority), next(self._sequence), tokens, function, future, loop))
        return await future

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task.function is None:
                return
            if task.future.cancelled():  # its requester is gone
                continue
            started = time.perf_counter()
            try:
                result, error = task.function(), None
            except BaseException as exception:  # handed to the awaiting handler, which reports it
                result, error = None, exception
            self.busy_seconds += time.perf_counter() - started
            self.tokens_processed += task.tokens
            try:
                task.loop.call_soon_threadsafe(_settle, task.future, result, error)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                return


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
