"""The serving engine's batch policy: which queued tasks run next, merged how, on how many threads.

A pure policy: every decision takes the time ``now`` (seconds on any monotonic clock) as an argument
and nothing here reads a clock, sleeps or starts a thread, so tests drive it on a fake clock.
``ServingEngine`` calls it under its lock: ``push`` when a task is submitted, ``next_batch`` from the
compute thread, ``finished`` with the seconds a batch took.

Tasks run most-urgent-first (lower priority value first, then arrival order). A decode step is one
task for all blocks of its span; a long prefill or a forward/backward pass is one task per block
(and a prefill one per chunk of tokens), so other sessions' decode steps slip in between its parts.

Tasks with a batch key merge: the batch is the first task and every queued task with its key, up to
``max_batch_tokens`` (e.g. the decode steps of several sessions, run as one forward per block).
Besides, a batch may wait up to ``merge_window`` seconds (counted from its first task's arrival) for
the steps of other members (sessions) of its key that are expected within that time: each member's
next arrival is predicted from the interval between its last two. A lone session never waits;
neither does a batch while a task of another key is queued.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

MAX_BATCH_TOKENS = 256  # decode steps merged into one call carry at most this many tokens in total
# tasks of up to this many tokens are small: their ops may gain nothing from more threads (and idle
# OpenMP workers spinning after every op steal the CPU other processes need), or may, on wide layers
# with memory bandwidth per core to spare. While a server serves several sessions, small tasks run on
# ``ThreadChoice.busy`` threads; otherwise, and for every larger task, ``ThreadChoice`` measures which
# count is faster. Measured on 2 cores shared with other work (load 3-4): a deep prompt tuning step of
# [4, 31] tokens of SmolLM2 through 3 local servers took 1.3 s with one-thread servers, 4 to 13 s
# with two-thread ones; on idle cores, both about 1 s.
SMALL_TASK_TOKENS = 64
ACTIVE_SECONDS = 1.0  # a member whose last step is older than this is not waited for


class Priority(IntEnum):
    DECODE = 0  # short inference steps: one task for all blocks of the span
    PREFILL = 1  # long inference steps, one task per block and chunk
    FORWARD = 2  # rpc_forward / rpc_backward, one task per block


@dataclass(order=True)
class Task:
    """One unit of compute: ``run([item, ...])`` returns one result per item of the batch it heads."""

    priority: int
    tokens: int = field(compare=False)
    run: Callable[[list[Any]], list[Any]] = field(compare=False)
    sequence: int = 0  # set by ``Scheduler.push``: ties of priority run first come, first served
    item: Any = field(compare=False, default=None)
    key: Hashable | None = field(compare=False, default=None)  # tasks with equal keys may merge
    member: Hashable | None = field(compare=False, default=None)  # who submits steps again and again
    submitted: float = field(compare=False, default=0.0)
    owner: Any = field(compare=False, default=None)  # the engine's bookkeeping (the job it belongs to)
    # what it computes, where tasks of one priority and size differ in cost (a block's backward against
    # its forward): the thread count is learned for each apart
    work: str = field(compare=False, default="")
    blocks: int = field(compare=False, default=1)  # blocks its tokens go through (a decode step: its span's)


def task_kind(priority: int, work: str, tokens: int) -> Hashable:
    """What ``ThreadChoice`` learns a count for: tasks alike in cost (same priority and work, sizes within 2x)."""
    return (int(priority), work, tokens.bit_length())


def call(
    priority: Priority, tokens: int, function: Callable[[], Any], work: str = "", blocks: int = 1
) -> Task:
    """A task that runs ``function()`` alone and yields its result (``tokens`` through ``blocks`` blocks)."""
    return Task(int(priority), tokens, lambda items: [function()], work=work, blocks=blocks)


@dataclass
class Batch:
    """Tasks to run with one call of the first one's ``run``, and on how many torch threads."""

    tasks: list[Task]
    threads: int
    learning: Hashable | None = None  # the kind of task whose thread count this run teaches

    @property
    def tokens(self) -> int:
        return sum(task.tokens for task in self.tasks)

    @property
    def token_blocks(self) -> int:
        """Tokens times the blocks each went through: the work done, in one unit whatever the task."""
        return sum(task.tokens * task.blocks for task in self.tasks)


class Scheduler:
    """The queue of tasks and the decisions over it (see the module docstring)."""

    def __init__(
        self,
        max_threads: int,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        merge_window: float = 0.0,
        small_task_threads: int = 0,
    ) -> None:
        self.max_threads, self.max_batch_tokens, self.merge_window = (
            max_threads,
            max_batch_tokens,
            merge_window,
        )
        # small tasks: that many threads, or (0) whichever of one and all the tasks' own times favour
        self.threads = ThreadChoice(max_threads, small_task_threads)
        self._heap: list[Task] = []
        self._sequence = itertools.count()
        self._arrivals: dict[Hashable, _Arrivals] = {}  # by member: when its next step is expected
        self.batches_merged = 0  # batches that ran more than one task at once
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # tasks per batchable call

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, task: Task, now: float) -> None:
        task.sequence, task.submitted = next(self._sequence), now
        if task.member is not None:
            self._arrivals.setdefault(task.member, _Arrivals()).arrived(task.key, now)
        heapq.heappush(self._heap, task)

    def forget(self, member: Hashable) -> None:
        """``member`` submits no more steps: no batch waits for it."""
        self._arrivals.pop(member, None)

    def drop(self, unwanted: Callable[[Task], bool]) -> list[Task]:
        """Remove and return the queued tasks ``unwanted`` picks (e.g. those nobody waits for any more)."""
        dropped = [task for task in self._heap if unwanted(task)]
        if dropped:
            self._heap = [task for task in self._heap if not unwanted(task)]
            heapq.heapify(self._heap)
        return dropped

    def next_batch(self, now: float) -> Batch | float | None:
        """The batch to run now; else how many seconds it may wait for more of its key; None when idle."""
        if not self._heap:
            return None
        batch = self._same_key_batch()
        wait = self._merge_wait(batch, now)
        if wait > 0:
            return wait
        taken = {id(task) for task in batch}
        self._heap = [task for task in self._heap if id(task) not in taken]
        heapq.heapify(self._heap)
        if batch[0].key is not None:
            self.batch_sizes[len(batch)] += 1
        self.batches_merged += len(batch) > 1
        return self._with_threads(batch, now)

    def finished(self, batch: Batch, seconds: float) -> None:
        """A batch ran in ``seconds``: learn from it when it was run to learn."""
        if batch.learning is not None:
            self.threads.record(batch.learning, batch.threads, seconds)

    def _same_key_batch(self) -> list[Task]:
        """The most urgent task, and the queued tasks of its key as long as their tokens allow."""
        first = self._heap[0]
        batch = [first]
        if first.key is None:
            return batch
        tokens = first.tokens
        for task in sorted(self._heap)[1:]:
            if task.key == first.key and tokens + task.tokens <= self.max_batch_tokens:
                batch.append(task)
                tokens += task.tokens
        return batch

    def _merge_wait(self, batch: list[Task], now: float) -> float:
        """Seconds to wait for more of the batch's key: until the next expected member, within the window."""
        first = batch[0]
        if first.key is None or len(self._heap) > len(batch):  # other work is waiting
            return 0.0
        deadline = first.submitted + self.merge_window
        if now >= deadline or sum(task.tokens for task in batch) >= self.max_batch_tokens:
            return 0.0
        present = {task.member for task in batch}
        expected = (
            arrivals.expected
            for member, arrivals in self._arrivals.items()
            if member not in present and arrivals.key == first.key and arrivals.active(now)
        )
        if not any(when <= deadline for when in expected):
            return 0.0
        return deadline - now

    def _serving_several(self, now: float) -> bool:
        """Whether other work is queued, or more than one member stepped within ``ACTIVE_SECONDS``."""
        return bool(self._heap) or sum(arrivals.active(now) for arrivals in self._arrivals.values()) > 1

    def _with_threads(self, tasks: list[Task], now: float) -> Batch:
        tokens = sum(task.tokens for task in tasks)
        if tokens > SMALL_TASK_TOKENS:
            if not self.threads.learning:  # a fixed --decode_threads is for small tasks
                return Batch(tasks, self.max_threads)
        elif len(tasks) > 1 or self._serving_several(now):
            # several sessions at once: every core is better spent on their work than on spinning
            return Batch(tasks, self.threads.busy)
        kind = task_kind(tasks[0].priority, tasks[0].work, tokens)
        threads = self.threads.pick(kind)
        return Batch(tasks, threads, kind if self.threads.learning else None)


class ThreadChoice:
    """How many torch threads tasks run on: a fixed number (small tasks), or one or all, learned from their times.

    Learning, per kind of task: its first ``2 * EXPLORE`` tasks alternate between one thread and all,
    then each task runs on the count with the lower mean time (an exponential moving average), and
    every ``REVISIT``-th on the other one, so that a change in the machine's load is noticed. It
    learns from a server serving one session: while it serves several, small tasks run on ``busy``
    threads (one, unless fixed), as spinning OpenMP workers would take the cores their steps need
    (``benchmarks.concurrent_sessions`` shows the server CPU per token either way). Results do not
    depend on the count (the same kernels split the same outputs over threads).
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
        self._tasks[kind] += 1
        if seen < 2 * self.EXPLORE:
            return self.counts[seen % 2]
        faster = self.preferred(kind)
        slower = self.counts[1] if faster == self.counts[0] else self.counts[0]
        return slower if seen % self.REVISIT == 0 else faster

    def preferred(self, kind: Hashable) -> int | None:
        """The count tasks of ``kind`` run on now (None: still exploring)."""
        if not self.learning:
            return self.busy
        if self._tasks[kind] < 2 * self.EXPLORE or any(
            (kind, count) not in self.mean_seconds for count in self.counts
        ):
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
