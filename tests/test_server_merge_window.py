"""``--merge_window``: a decode step waits for other active sessions' steps expected within the window.

The compute queue predicts each session's next step from the interval between its last two; a step
waits only for sessions expected by the end of its window, so a lone session, or one whose partner
has ended, never waits. The windows here are seconds long: a step that waited would show it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from petals.server.scheduler import ComputeQueue, Priority

KEY = ("blocks 0:4", 1, "float32")


@pytest.fixture
def calls():
    return []


@pytest.fixture
def queue():
    queue = ComputeQueue(merge_window=30.0)
    queue.start()
    yield queue
    queue.shutdown()


def recorder(calls):
    def run(items):
        calls.append(list(items))
        return items

    return run


async def step(queue, calls, member, item):
    return await queue.run_batched(Priority.DECODE, 1, KEY, item, recorder(calls), member=member)


def test_a_step_waits_for_a_session_expected_within_the_window(queue, calls):
    async def scenario():
        await step(queue, calls, "b", "b1")
        await asyncio.sleep(0.2)
        await step(queue, calls, "b", "b2")  # b now comes every ~0.2 s: next expected ~0.2 s from now
        started = time.perf_counter()
        a = asyncio.create_task(step(queue, calls, "a", "a1"))
        await asyncio.sleep(0.3)
        b = asyncio.create_task(step(queue, calls, "b", "b3"))
        await asyncio.gather(a, b)
        return time.perf_counter() - started

    waited = asyncio.run(scenario())
    assert calls[-1] == ["a1", "b3"]  # one call for both: a's step waited for b's
    assert waited < 10  # it ended when b came, not at the end of the 30 s window


def test_a_lone_session_never_waits(queue, calls):
    async def scenario():
        started = time.perf_counter()
        for index in range(4):
            await step(queue, calls, "a", f"a{index}")
            await asyncio.sleep(0.05)
        return time.perf_counter() - started

    assert asyncio.run(scenario()) < 10
    assert calls == [["a0"], ["a1"], ["a2"], ["a3"]]


def test_no_step_waits_for_a_session_that_ended(queue, calls):
    async def scenario():
        await step(queue, calls, "b", "b1")
        await asyncio.sleep(0.1)
        await step(queue, calls, "b", "b2")
        queue.forget("b")
        started = time.perf_counter()
        await step(queue, calls, "a", "a1")
        return time.perf_counter() - started

    assert asyncio.run(scenario()) < 10
    assert calls[-1] == ["a1"]


def test_without_a_window_steps_that_arrive_apart_run_apart(calls):
    queue = ComputeQueue()
    queue.start()

    async def scenario():
        await step(queue, calls, "b", "b1")
        await asyncio.sleep(0.1)
        await step(queue, calls, "b", "b2")
        a = asyncio.create_task(step(queue, calls, "a", "a1"))
        await asyncio.sleep(0.1)
        await asyncio.gather(a, step(queue, calls, "b", "b3"))

    try:
        asyncio.run(scenario())
    finally:
        queue.shutdown()
    assert calls[-2:] == [["a1"], ["b3"]]
