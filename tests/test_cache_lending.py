"""Whose cache pages are they: idle pages lent, ended sessions kept and continued, preemption by age, and
a fair admission queue. Real arenas, pools and caches of every kind (no forward: steps are taken as the
engine takes them), on a fake clock."""

import asyncio
import dataclasses
import threading
from typing import ClassVar

import pytest
import torch

from conftest import tiny_config
from petals.kv_cache import (
    MANAGERS,
    AttentionCache,
    CacheGroup,
    FullAttentionSpec,
    HybridSpec,
    KindCache,
    Lender,
    LinearAttentionSpec,
    PageArena,
    PagePool,
    SessionPreempted,
    SlidingWindowSpec,
    StatePool,
    furthest_common,
    open_cache,
)
from petals.server.backend import BlockBackend
from petals.server.cache_budget import AllocationFailed, CacheBudget
from petals_llama.config import DistributedLlamaConfig

SPEC = FullAttentionSpec(num_kv_heads=1, key_dim=2, value_dim=2, num_query_heads=1)  # 16 bytes a token
SPAN = (("tiny.0",), 1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def lender(clock) -> Lender:
    return Lender(threading.RLock(), clock, max_kept=2, kept_seconds=60)


@pytest.fixture
def pool(lender) -> PagePool:
    """Eight pages of four tokens, on the lender's arena."""
    arena = PageArena(8, 4 * 16, lock=lender.lock)
    arena.lender = lender
    return PagePool(SPEC, arena=arena)


def session(lender: Lender, pool: PagePool, tokens: int = 0, span=SPAN):
    """A session admitted now, on ``pool``, grown by ``tokens`` tokens (its lease, its cache)."""
    lease = lender.admit(span)
    cache = open_cache(SPEC, 1, 64, pool=pool, lease=lease)
    lease.caches.append(cache)
    grow(cache, tokens)
    return lease, cache


def grow(cache, tokens: int) -> None:
    """A step of ``tokens`` tokens, as the engine runs one: reserve, then written."""
    cache.reserve(tokens)
    cache.advance(tokens)


def test_a_kind_is_a_class_that_registers_itself_for_the_specs_it_serves():
    @dataclasses.dataclass(frozen=True)
    class EchoSpec(FullAttentionSpec):
        kind: ClassVar[str] = "echo"

    try:

        class EchoCache(AttentionCache):
            serves = (EchoSpec,)

        spec = EchoSpec(num_kv_heads=1, key_dim=2, value_dim=2, num_query_heads=1)
        assert MANAGERS[EchoSpec] is EchoCache and type(open_cache(spec, 1, 8)) is EchoCache
        with pytest.raises(TypeError, match="EchoSpec is served by EchoCache already"):

            class Twin(AttentionCache):
                serves = (EchoSpec,)

    finally:
        MANAGERS.pop(EchoSpec, None)


def test_every_kind_is_one_page_table_class_or_a_group_of_them():
    for spec_type, manager in MANAGERS.items():
        assert issubclass(manager, KindCache | CacheGroup), f"{spec_type.kind}: {manager.__name__}"
        for method in ("reserve", "resumable", "rewind", "reorder", "release", "view", "merged"):
            assert callable(getattr(manager, method)), f"{manager.__name__} has no {method}"


def test_an_idle_sessions_pages_count_as_free_and_go_to_a_session_that_needs_them(lender, pool):
    idle, _ = session(lender, pool, tokens=24)  # six of eight pages
    assert lender.lend(idle) == 6
    assert lender.pages(pool.arena) == {"live": 0, "kept": 6, "free": 2}
    assert pool.arena.available_pages == 8
    growing, cache = session(lender, pool, tokens=8)
    grow(cache, 8)  # four pages: two of them the idle session's, and the idle session gives all its pages up
    assert lender.reclaimed == 1 and lender.preemptions == 0
    assert lender.pages(pool.arena) == {"live": 4, "kept": 0, "free": 4}
    with pytest.raises(SessionPreempted, match="was idle and its pages went to another session"):
        idle.use()
    again, _ = session(lender, pool, tokens=4)
    lender.lend(again)
    again.use()  # it stepped again before anyone needed its pages: live, as it was
    assert lender.pages(pool.arena) == {"live": 5, "kept": 0, "free": 3}


def test_a_growing_session_preempts_the_most_recently_admitted_never_an_older_one(lender, pool):
    oldest, _ = session(lender, pool, tokens=8)  # two pages
    middle, middle_cache = session(lender, pool, tokens=12)  # three
    newest, _ = session(lender, pool, tokens=12)  # three: the arena is full
    grow(middle_cache, 4)  # the middle one needs a page: the newest gives all its pages up
    assert lender.preemptions == 1 and len(lender) == 2
    assert lender.pages(pool.arena) == {"live": 6, "kept": 0, "free": 2}
    with pytest.raises(SessionPreempted, match="went to an older session"):
        newest.use()
    with pytest.raises(
        SessionPreempted
    ):  # now the newest itself, it gives its own pages up, not the oldest's
        grow(middle_cache, 16)
    assert middle_cache.pages_held == 0 and oldest.total_pages == 2 and not oldest.preempted
    assert lender.preemptions == 2 and pool.arena.free_pages == 6


def test_a_kept_session_is_continued_only_by_its_own_client_over_the_same_blocks(lender, pool, clock):
    lease, cache = session(lender, pool, tokens=10)
    clock.now = 5.0
    assert lender.keep(lease, ("alice", "chat")) == 3
    assert lender.pages(pool.arena) == {"live": 0, "kept": 3, "free": 5} and lender.kept == 1
    assert lender.mean_lifetime == 5.0  # a kept session counts as ended, for admission's wait estimates
    assert lender.resume(("mallory", "chat"), SPAN) is None  # another client's key: not found
    assert lender.resume(("alice", "chat"), (("tiny.1",), 1)) is None  # other blocks: not found either
    resumed = lender.resume(("alice", "chat"), SPAN)
    assert resumed is lease and resumed.caches == [cache] and cache.position == 10
    assert lender.pages(pool.arena) == {"live": 3, "kept": 0, "free": 5} and lender.kept == 0
    assert furthest_common(resumed.caches, 7) == 7  # keys and values rewind anywhere
    cache.rewind(7)
    grow(cache, 1)
    assert lender.resume(("alice", "chat"), SPAN) is None  # continued once: no longer kept


def test_kept_sessions_are_bounded_by_count_and_by_idle_time(lender, pool, clock):
    kept = [session(lender, pool, tokens=4)[0] for _ in range(3)]
    for index, lease in enumerate(kept):
        clock.now = index
        lender.keep(lease, ("alice", f"chat {index}"))
    assert lender.kept == 2 and kept[0].state == "gone"  # at most two: the least recently used went
    assert pool.arena.free_pages == 6
    clock.now = 61.5  # "chat 1" unused for over a minute, "chat 2" not quite
    assert lender.resume(("alice", "chat 1"), SPAN) is None
    assert lender.resume(("alice", "chat 2"), SPAN) is kept[2]


def test_a_state_resumes_at_its_last_steps_and_a_hybrid_where_both_its_parts_can():
    state = LinearAttentionSpec(conv_dim=4, conv_kernel=2, recurrent_shape=(1, 2, 2), snapshots=2)
    sliding = SlidingWindowSpec(
        num_kv_heads=1, key_dim=2, value_dim=2, num_query_heads=1, window=4, rewind_margin=2
    )
    hybrid = open_cache(HybridSpec(attention=sliding, state=state), 1, 64)
    for tokens in (20, 1, 3, 1):  # as a forward does: reserve, snapshot the state, write both
        hybrid.reserve(tokens)
        hybrid.state.snapshot()
        hybrid.state.advance(tokens)
        hybrid.attention.advance(tokens)
    assert hybrid.position == 25 and [kept for kept, _ in hybrid.state.snapshots] == [21, 24]
    assert hybrid.state.resumable(23) == 21 and hybrid.state.resumable(25) == 25
    assert hybrid.attention.first_held == 16  # its first page fell out of the window and its margin
    assert hybrid.attention.resumable(22) == 22 and hybrid.attention.resumable(18) == 0
    assert hybrid.resumable(24) == 24 and hybrid.resumable(23) == 21 and hybrid.resumable(18) == 0
    with pytest.raises(ValueError, match="a linear-attention state goes back only"):
        hybrid.rewind(23)
    assert hybrid.position == hybrid.attention.position == 25  # refused before any part moved
    hybrid.rewind(21)
    assert hybrid.position == hybrid.state.position == 21


def test_a_kept_states_pages_are_reclaimed_like_any_kinds(lender):
    spec = LinearAttentionSpec(conv_dim=4, conv_kernel=2, recurrent_shape=(1, 2, 2))
    arena = PageArena(2, StatePool.slot_nbytes(spec, torch.float32), lock=lender.lock)
    arena.lender = lender
    pool = StatePool(spec, arena=arena)
    kept = lender.admit(SPAN)
    kept.caches.append(open_cache(spec, 2, 64, pool=pool, lease=kept))  # both slots
    lender.keep(kept, ("alice", "chat"))
    newcomer = lender.admit(SPAN)
    newcomer.caches.append(open_cache(spec, 1, 64, pool=pool, lease=newcomer))  # takes the kept ones' pages
    assert kept.state == "gone" and lender.reclaimed == 1 and arena.free_pages == 1


def llama_backends(blocks: int = 1) -> list[BlockBackend]:
    config = DistributedLlamaConfig.from_dict(tiny_config("llama").to_dict())
    return [
        BlockBackend(f"tiny.{index}", index, torch.nn.Identity(), config, torch.float32, torch.device("cpu"))
        for index in range(blocks)
    ]


def test_sessions_wait_for_admission_in_line_first_come_first_served(clock):
    backends = llama_backends()
    budget = CacheBudget(backends, tokens_per_block=64, page_tokens=16, clock=clock)  # four pages
    holder = asyncio.run(budget.admit(backends, 1, 64, 16, timeout=0))
    held = budget.open_caches(backends, 1, 64, holder)
    for cache in held:
        grow(cache, 64)
    assert budget.queue() == {"waiting": 0, "wait_seconds": None}  # no session has ended yet

    async def in_line() -> list[str]:
        admitted = []

        async def wait(name: str, tokens: int) -> None:
            await budget.admit(backends, 1, 64, tokens, timeout=30)
            admitted.append(name)

        first = asyncio.create_task(wait("first", 48))  # three pages
        await asyncio.sleep(0.05)
        second = asyncio.create_task(wait("second", 16))  # one page
        await asyncio.sleep(0.05)
        assert budget.queue()["waiting"] == 2
        with pytest.raises(AllocationFailed, match="2 sessions wait ahead in line"):
            await budget.admit(backends, 1, 64, 16, timeout=0)
        await asyncio.to_thread(held[0].rewind, 32)  # two pages back: enough for the second, not the first
        await asyncio.sleep(0.2)
        assert admitted == []  # the second waits behind the first
        clock.now = 10.0
        await asyncio.to_thread(budget.lender.end, holder)  # the rest: both fit now, in their order
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        return admitted

    assert asyncio.run(in_line()) == ["first", "second"]
    assert budget.queue() == {
        "waiting": 0,
        "wait_seconds": 10.0 * 1 / 2,
    }  # one session's lifetime over two live
