"""Steps run on one torch thread or on all, whichever their own times favour (``--decode_threads``: small ones).

``ThreadChoice`` is fed the times a kind of task took: it tries both counts first, then uses the
faster, revisits the other now and then, and follows when the machine's load turns the tables. A
fixed ``--decode_threads`` is used as given, and a server reports its count in ``rpc_info``.
"""

from __future__ import annotations

import pytest
import torch

from petals.data_structures import make_uids
from petals.server.scheduler import SMALL_TASK_TOKENS, Priority, Scheduler, ThreadChoice, call
from petals.testing.swarm import inprocess_swarm
from petals.testing.wire_client import WireClient

KIND = ("decode", 1)
HIDDEN = 64  # the tiny Llama's


def run(choice: ThreadChoice, tasks: int, seconds_on: dict[int, float]) -> list[int]:
    """The counts ``tasks`` tasks ran on, each taking ``seconds_on[count]``."""
    counts = []
    for _ in range(tasks):
        count = choice.pick(KIND)
        choice.record(KIND, count, seconds_on[count])
        counts.append(count)
    return counts


def test_it_tries_both_then_keeps_the_faster_and_revisits_the_slower():
    choice = ThreadChoice(max_threads=4)
    assert choice.preferred(KIND) is None
    counts = run(choice, 2 * ThreadChoice.EXPLORE + 2 * ThreadChoice.REVISIT, {1: 0.002, 4: 0.005})
    explore = counts[: 2 * ThreadChoice.EXPLORE]
    assert explore == [1, 4] * ThreadChoice.EXPLORE
    later = counts[2 * ThreadChoice.EXPLORE :]
    assert later.count(4) == 2 and later.count(1) == len(later) - 2  # the slower one, once every REVISIT
    assert choice.preferred(KIND) == 1 and choice.describe(KIND) == {"decode_threads": 1}


def test_it_follows_when_the_other_count_becomes_faster():
    choice = ThreadChoice(max_threads=2)
    run(choice, 40, {1: 0.002, 2: 0.004})
    assert choice.preferred(KIND) == 1
    counts = run(choice, 8 * ThreadChoice.REVISIT, {1: 0.006, 2: 0.003})  # say, wider steps now
    assert choice.preferred(KIND) == 2
    assert counts[-ThreadChoice.REVISIT + 1 :].count(2) >= ThreadChoice.REVISIT - 2


def test_kinds_are_learned_apart():
    choice = ThreadChoice(max_threads=2)
    for _ in range(20):
        for kind, faster in ((("decode", 1), 1), (("forward", 5), 2)):
            count = choice.pick(kind)
            choice.record(kind, count, 0.001 if count == faster else 0.003)
    assert choice.preferred(("decode", 1)) == 1 and choice.preferred(("forward", 5)) == 2


@pytest.mark.parametrize("max_threads, fixed, expected", [(4, 3, 3), (1, 0, 1)])
def test_a_fixed_count_or_a_single_core_needs_no_learning(max_threads, fixed, expected):
    choice = ThreadChoice(max_threads, fixed)
    assert run(choice, 5, {expected: 0.001}) == [expected] * 5
    assert choice.describe(KIND) == {"decode_threads": expected}


def large_task_threads(scheduler: Scheduler, tasks: int, seconds_on: dict[int, float]) -> list[int]:
    """The counts ``tasks`` forward tasks of a training step's size ran on, each taking ``seconds_on[count]``."""
    counts = []
    for index in range(tasks):
        scheduler.push(call(Priority.FORWARD, 4 * SMALL_TASK_TOKENS, lambda: None), now=float(index))
        batch = scheduler.next_batch(float(index))
        scheduler.finished(batch, seconds_on[batch.threads])
        counts.append(batch.threads)
    return counts


def test_larger_tasks_learn_their_count_too_unless_it_is_fixed():
    """On cores other work shares, a hundred-token block can run faster on one thread than on all."""
    counts = large_task_threads(Scheduler(max_threads=2), 40, {1: 0.010, 2: 0.050})
    assert counts[: 2 * ThreadChoice.EXPLORE] == [1, 2] * ThreadChoice.EXPLORE
    assert counts[2 * ThreadChoice.EXPLORE :].count(1) >= 40 - 2 * ThreadChoice.EXPLORE - 2
    fixed = Scheduler(max_threads=2, small_task_threads=1)  # --decode_threads 1: small tasks only
    assert large_task_threads(fixed, 5, {1: 0.010, 2: 0.050}) == [2] * 5


def test_a_blocks_backward_and_its_forward_of_one_size_learn_their_counts_apart():
    """A training step sends forward and backward tasks of the same priority and size, which cost 2-3x
    apart: were they one kind, each count's mean would mix them in whatever order they happened to run."""
    scheduler = Scheduler(max_threads=2)
    tokens = 4 * SMALL_TASK_TOKENS
    seconds_on = {"forward+graph": {1: 0.010, 2: 0.020}, "backward": {1: 0.060, 2: 0.030}}
    ran: dict[str, list[int]] = {"forward+graph": [], "backward": []}
    for index in range(40):
        for work in ("forward+graph", "backward"):
            scheduler.push(call(Priority.FORWARD, tokens, lambda: None, work), now=float(index))
            batch = scheduler.next_batch(float(index))
            scheduler.finished(batch, seconds_on[work][batch.threads])
            ran[work].append(batch.threads)
    explored = 2 * ThreadChoice.EXPLORE
    assert ran["forward+graph"][explored:].count(1) >= 40 - explored - 2
    assert ran["backward"][explored:].count(2) >= 40 - explored - 2


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [(("--decode_threads", "1"), {1}), ((), {1, 2})])
def test_a_server_reports_its_decode_threads(tiny_model_path, args, expected):
    with inprocess_swarm(tiny_model_path("llama"), "0:4", server_args=args) as (dht, (server,)):
        client = WireClient(dht.initial_peers)
        try:
            stream = client.inference(server.peer_id, make_uids("tiny-llama-hf", 0, 4), max_length=64)
            for _ in range(2 * ThreadChoice.EXPLORE + 1):
                stream.step(torch.randn(1, 1, HIDDEN))
            stream.close()
            assert client.info(server.peer_id)["stats"]["decode_threads"] in expected
        finally:
            client.close()
