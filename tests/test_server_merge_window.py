"""``--merge_window``: a decode step waits for other active sessions' steps expected within the window.

The batch policy predicts each session's next step from the interval between its last two; a step
waits only for sessions expected by the end of its window, so a lone session, or one whose partner
has ended, never waits. The policy takes the time as an argument: these tests run on a fake clock.
"""

from __future__ import annotations

from petals.server.scheduler import ACTIVE_SECONDS, Batch, Priority, Scheduler, Task

KEY = ("blocks 0:4", 1, "float32")
OTHER_KEY = ("blocks 0:4", 2, "float32")


def decode(member: str, key: tuple = KEY, tokens: int = 1) -> Task:
    return Task(Priority.DECODE, tokens, lambda items: items, item=f"{member}", key=key, member=member)


def ran(scheduler: Scheduler, now: float) -> list[str]:
    """The items of the batch the policy runs at ``now`` (it must not ask to wait)."""
    batch = scheduler.next_batch(now)
    assert isinstance(batch, Batch), f"expected a batch at t={now}, got {batch!r}"
    return [task.item for task in batch.tasks]


def test_a_step_waits_for_a_session_expected_within_the_window():
    scheduler = Scheduler(max_threads=2, merge_window=30.0)
    scheduler.push(decode("b"), now=0.0)
    assert ran(scheduler, 0.0) == ["b"]
    scheduler.push(decode("b"), now=0.2)  # b now comes every 0.2 s: next expected at 0.4
    assert ran(scheduler, 0.2) == ["b"]
    scheduler.push(decode("a"), now=0.25)
    assert scheduler.next_batch(0.25) == 30.0  # a waits, at most until its window ends
    assert scheduler.next_batch(0.3) == 29.95
    scheduler.push(decode("b"), now=0.4)
    assert ran(scheduler, 0.4) == ["a", "b"]  # one call for both: a's step waited for b's


def test_a_step_waits_no_longer_than_its_window():
    scheduler = Scheduler(max_threads=2, merge_window=0.05)
    for now in (0.0, 0.2):
        scheduler.push(decode("b"), now=now)
        ran(scheduler, now)
    scheduler.push(decode("a"), now=0.39)  # b is expected at 0.4, within a's window
    assert scheduler.next_batch(0.39) > 0
    assert ran(scheduler, 0.44) == ["a"]  # b is late: a runs when its window ends


def test_a_lone_session_never_waits():
    scheduler = Scheduler(max_threads=2, merge_window=30.0)
    for index in range(4):
        scheduler.push(decode("a"), now=index * 0.05)
        assert ran(scheduler, index * 0.05) == ["a"]


def test_no_step_waits_for_a_session_that_ended():
    scheduler = Scheduler(max_threads=2, merge_window=30.0)
    for now in (0.0, 0.1):
        scheduler.push(decode("b"), now=now)
        ran(scheduler, now)
    scheduler.forget("b")
    scheduler.push(decode("a"), now=0.15)
    assert ran(scheduler, 0.15) == ["a"]


def test_no_step_waits_for_a_session_that_went_quiet():
    scheduler = Scheduler(max_threads=2, merge_window=30.0)
    for now in (0.0, 0.1):
        scheduler.push(decode("b"), now=now)
        ran(scheduler, now)
    later = 0.1 + ACTIVE_SECONDS  # b's prediction is stale: it has not stepped for a while
    scheduler.push(decode("a"), now=later)
    assert ran(scheduler, later) == ["a"]


def test_no_batch_waits_while_other_work_is_queued():
    scheduler = Scheduler(max_threads=2, merge_window=30.0)
    for now in (0.0, 0.2):
        scheduler.push(decode("b"), now=now)
        ran(scheduler, now)
    scheduler.push(decode("a"), now=0.25)
    scheduler.push(decode("c", key=OTHER_KEY), now=0.26)
    assert ran(scheduler, 0.26) == ["a"]
    assert ran(scheduler, 0.26) == ["c"]


def test_without_a_window_steps_that_arrive_apart_run_apart():
    scheduler = Scheduler(max_threads=2)
    for now in (0.0, 0.1):
        scheduler.push(decode("b"), now=now)
        ran(scheduler, now)
    scheduler.push(decode("a"), now=0.15)
    assert ran(scheduler, 0.15) == ["a"]
    scheduler.push(decode("b"), now=0.2)
    assert ran(scheduler, 0.2) == ["b"]


def test_queued_steps_of_one_key_merge_up_to_the_token_limit():
    scheduler = Scheduler(max_threads=2, max_batch_tokens=4)
    for member in "abc":
        scheduler.push(decode(member, tokens=2), now=0.0)
    assert ran(scheduler, 0.0) == ["a", "b"]
    assert ran(scheduler, 0.0) == ["c"]
    assert scheduler.batches_merged == 1 and scheduler.batch_sizes == {2: 1, 1: 1}
