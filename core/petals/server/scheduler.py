"""One compute thread for all torch work, fed by a priority queue that merges concurrent decode steps.

The event loop never runs torch: handlers ``await queue.run(...)`` and the worker thread runs tasks
most-urgent-first (lower priority value first, then arrival order). A decode step is one task for
all blocks of its span; a long prefill or a forward/backward pass is submitted one block at a time
(and a prefill in chunks of tokens), so other sessions' decode steps slip in between its parts
instead of waiting for the whole pass.

Tasks submitted with ``run_batched`` carry a batch key: when the worker takes one, it also takes
every queued task with the same key and runs them all with one call of their batch function
(e.g. the decode steps of several sessions, as one forward per block). Steps that arrive while the
worker is busy are merged. Besides, a batch may wait up to ``merge_window`` seconds (counted from
its first task's arrival) for the steps of other members (sessions) of its key that are expected
within that time: each member's next arrival is predicted from the interval between its last two.
A lone session never waits; neither does a batch while a task of another key is queued.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from petals.server import metrics

logger = logging.getLogger(__name__)

MAX_BATCH_TOKENS = 256  # decode steps merged into one call carry at most this many tokens in total
# tasks of up to this many tokens are small: their ops may gain nothing from more threads (and idle
# OpenMP workers spinning after every op steal the CPU other processes need), or may, on wide layers
# with memory bandwidth per core to spare; ``ThreadChoice`` measures which. Larger tasks use all.
SMALL_TASK_TOKENS = 64
ACTIVE_SECONDS = 1.0  # a member whose last step is older than this is not waited for


class Priority(IntEnum):
    DECODE = 0  # short inference steps: one task for all blocks of the span
    PREFILL = 1  # long inference steps, one task per block and chunk
    FORWARD = 2  # rpc_forward / rpc_backward, one task per block


@dataclass(order=True)
class _Task:
    priority: int
    sequence: int
    tokens: int = field(compare=False)
    function: Callable[[list[Any]], list[Any]] = field(compare=False)
    item: Any = field(compare=False)
    key: Hashable | None = field(compare=False)
    member: Hashable | None = field(compare=False)
    future: asyncio.Future = field(compare=False)
    loop: asyncio.AbstractEventLoop = field(compare=False)
    submitted: float = field(default_factory=time.perf_counter, compare=False)


class ComputeQueue:
    """Runs submitted functions in one worker thread, most urgent first, merging batchable ones."""

    def __init__(
        self, max_batch_tokens: int = MAX_BATCH_TOKENS, merge_window: float = 0.0, small_task_threads: int = 0
    ) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.merge_window = merge_window
        self._arrivals: dict[Hashable, _Arrivals] = {}  # by member: when its next step is expected
        self._heap: list[_Task] = []
        self._changed = threading.Condition()
        self._stopping = False
        self._sequence = itertools.count()
        self._thread = threading.Thread(target=self._work, name="petals-compute", daemon=True)
        self.tokens_processed = 0
        self.busy_seconds = 0.0
        self.batches_merged = 0  # calls that ran more than one task at once
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # tasks per batchable call
        self._max_threads = torch.get_num_threads()
        # small tasks: that many threads, or (0) whichever of one and all the tasks' own times favour
        self.threads = ThreadChoice(self._max_threads, small_task_threads)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self._thread.join(timeout=30)

    async def run(self, priority: Priority, tokens: int, function: Callable[[], Any]) -> Any:
        """Run ``function()`` in the compute thread and return its result (or raise its exception)."""
        return await self._submit(priority, tokens, lambda items: [function()], None, None, None)

    async def run_batched(
        self,
        priority: Priority,
        tokens: int,
        key: Hashable,
        item: Any,
        function: Callable[[list[Any]], list[Any]],
        member: Hashable | None = None,
    ) -> Any:
        """Run ``function([item, ...])`` together with other queued items of the same ``key``.

        ``function`` returns one result per item, in order; this call returns ``item``'s. An
        exception fails every item of the batch. ``member`` (e.g. a session id) submits steps
        again and again: a batch of its key may wait for its next one (call ``forget`` at its end).
        """
        return await self._submit(priority, tokens, function, item, key, member)

    def forget(self, member: Hashable) -> None:
        """``member`` submits no more steps: no batch waits for it."""
        with self._changed:
            self._arrivals.pop(member, None)

    async def _submit(self, priority, tokens, function, item, key, member) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        task = _Task(int(priority), next(self._sequence), tokens, function, item, key, member, future, loop)
        with self._changed:
            if member is not None:
                self._arrivals.setdefault(member, _Arrivals()).arrived(key, task.submitted)
            heapq.heappush(self._heap, task)
            self._changed.notify()
        return await future

    def _next_batch(self) -> list[_Task] | None:
        with self._changed:
            while not self._heap and not self._stopping:
                self._changed.wait()
            if self._stopping:
                return None
            first = heapq.heappop(self._heap)
            batch = [first]
            if first.key is not None:
                self._take_same_key(batch)
                while (timeout := self._merge_wait(batch)) > 0:
                    self._changed.wait(timeout)
                    self._take_same_key(batch)
            return batch

    def _take_same_key(self, batch: list[_Task]) -> None:
        """Move queued tasks of the batch's key into it, as long as its tokens allow."""
        key, tokens, rest = batch[0].key, sum(task.tokens for task in batch), []
        for task in sorted(self._heap):
            if task.key == key and tokens + task.tokens <= self.max_batch_tokens:
                batch.append(task)
                tokens += task.tokens
            else:
                rest.append(task)
        if len(rest) < len(self._heap):
            self._heap = rest  # sorted, hence a valid heap

    def _serving_several(self) -> bool:
        """Whether other work is queued, or more than one member (session) stepped within ``ACTIVE_SECONDS``."""
        if self._heap:
            return True
        now = time.perf_counter()
        with self._changed:
            return sum(arrivals.active(now) for arrivals in self._arrivals.values()) > 1

    def _merge_wait(self, batch: list[_Task]) -> float:
        """Seconds to wait for more of the batch's key: until the next expected member, within the window."""
        if self._heap or self._stopping:  # other work is waiting, or nothing will come
            return 0.0
        now = time.perf_counter()
        deadline = batch[0].submitted + self.merge_window
        if now >= deadline:
            return 0.0
        key, present = batch[0].key, {task.member for task in batch}
        tokens = sum(task.tokens for task in batch)
        expected = [
            arrivals.expected
            for member, arrivals in self._arrivals.items()
            if member not in present and arrivals.key == key and arrivals.active(now)
        ]
        if tokens >= self.max_batch_tokens or not any(when <= deadline for when in expected):
            return 0.0
        return deadline - now

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            batch = [task for task in batch if not task.future.cancelled()]  # their requesters are gone
            if not batch:
                continue
            metrics.compute_batch_started([task.submitted for task in batch])
            tokens = sum(task.tokens for task in batch)
            try:
                results, error = self._execute(batch[0], [task.item for task in batch], tokens), None
            except BaseException as exception:  # handed to the awaiting handlers, which report it
                results, error = [None] * len(batch), exception
            self.batches_merged += len(batch) > 1
            if batch[0].key is not None:
                self.batch_sizes[len(batch)] += 1
            for task, result in zip(batch, results, strict=True):
                try:
                    task.loop.call_soon_threadsafe(_settle, task.future, result, error)
                except RuntimeError:  # the event loop is closed: the server is shutting down
                    return

    def _execute(self, first: _Task, items: list[Any], tokens: int) -> list[Any]:
        kind = (first.priority, tokens.bit_length())  # tasks alike in cost: the same kind, sizes within 2x
        learn = tokens <= SMALL_TASK_TOKENS and len(items) == 1 and not self._serving_several()
        if learn:
            threads = self.threads.pick(kind)
        else:  # several sessions at once: every core is better spent on their work than on spinning
            threads = self.threads.busy if tokens <= SMALL_TASK_TOKENS else self._max_threads
        torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            return first.function(items)
        finally:
            seconds = time.perf_counter() - started
            if learn:
                self.threads.record(kind, threads, seconds)
            self.busy_seconds += seconds
            self.tokens_processed += tokens


class ThreadChoice:
    """How many torch threads small tasks run on: a fixed number, or one or all, learned from their times.

    Learning, per kind of task: its first ``2 * EXPLORE`` tasks alternate between one thread and all,
    then each task runs on the count with the lower mean time (an exponential moving average), and
    every ``REVISIT``-th on the other one, so that a change in the machine's load is noticed. It
    learns from a server serving one session: while it serves several, small tasks run on ``busy``
    threads (one, unless fixed), as spinning OpenMP workers would take the cores their steps need
    (measured on 2 cores with 8 sessions: 53 ms of server CPU per token with two threads, 36 with
    one). Results do not depend on the count (the same kernels split the same outputs over threads).
    """

    EXPLORE, REVISIT, SMOOTHING = 4, 32, 0.2

    def __init__(self, max_threads: int, fixed: int = 0) -> None:
        self.counts = (1, max_threads)
        self.learning = not fixed and max_threads > 1
        self.busy = fixed or 1  # the count while serving several sessions, and the fixed one
        self.mean_seconds: dict[tuple[Hashable, int], float] = {}
        self._tasks: collections.Counter[Hashable] = collections.Counter()

    def pick(self, kind: Hashable) -> int:
        if not self.learning:
            return self.busy
        seen = self._tasks[kind]
        if seen < 2 * self.EXPLORE:
            self._tasks[kind] += 1
            return self.counts[seen % 2]
        faster = self.preferred(kind)
        self._tasks[kind] += 1
        slower = self.counts[1] if faster == self.counts[0] else self.counts[0]
        return slower if seen % self.REVISIT == 0 else faster

    def preferred(self, kind: Hashable) -> int | None:
        """The count tasks of ``kind`` run on now (None: still exploring)."""
        if not self.learning:
            return self.busy
        if self._tasks[kind] < 2 * self.EXPLORE:
            return None
        return min(self.counts, key=lambda count: self.mean_seconds[kind, count])

    def describe(self, kind: Hashable) -> dict[str, int]:
        """``{"decode_threads": count}`` once it is known, for ``rpc_info``'s stats."""
        preferred = self.preferred(kind)
        return {} if preferred is None else {"decode_threads": preferred}

    def record(self, kind: Hashable, threads: int, seconds: float) -> None:
        mean = self.mean_seconds.get((kind, threads))
        self.mean_seconds[kind, threads] = (
            seconds if mean is None else mean + self.SMOOTHING * (seconds - mean)
        )


@dataclass
class _Arrivals:
    """When a member's steps of one key arrived, and when its next one is expected."""

    key: Hashable | None = None
    last: float = float("-inf")
    interval: float = float("inf")

    def arrived(self, key: Hashable | None, when: float) -> None:
        self.interval = when - self.last if key == self.key else float("inf")
        self.key, self.last = key, when

    @property
    def expected(self) -> float:
        return self.last + self.interval

    def active(self, now: float) -> bool:
        """Whether the member stepped within the last ``ACTIVE_SECONDS``."""
        return now - self.last < ACTIVE_SECONDS


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
