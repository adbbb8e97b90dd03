"""Whose cache pages are they: leases, idle pages lent, ended sessions kept, and preemption.

Every session a server admits gets a ``Lease`` from the server's ``Lender``: the pages its caches hold
on each arena, counted as its pools take and give them back (``Pool.take`` / ``give_back``), whatever
their kind. A lease is

* live: its session computes, or is about to;
* idle: its client has been silent a while (``lend``): its pages are lent until its next step;
* kept: its session ended asking to be kept, under its client's key, for a later session of the same
  client to continue (``resume``); at most ``max_kept`` of them, each for at most ``kept_seconds``;
* gone: released, reclaimed or preempted.

Idle and kept pages count as available (``PageArena.kept_pages``): admission never waits for them.
When a session needs pages and fewer are free, its arena asks the lender to make room (``make_room``):
idle and kept leases give theirs back, least recently used first; then live ones, the most recently
admitted first (a preemption, as vLLM's recompute: that session's next step fails with
``SessionPreempted``, and its client replays it). A session never takes pages from an older one: when
it is itself the most recently admitted, it is the one preempted. Everything here runs under the
arenas' lock (one per server), from the event loop (admission, lending, keeping) or the compute thread
(steps), on the clock the lender is given.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from petals.kv_cache.arena import PageArena
from petals.kv_cache.base import SessionPreempted

LIVE, IDLE, KEPT, GONE = "live", "idle", "kept", "gone"
LENT = (IDLE, KEPT)
MAX_KEPT_SESSIONS = 32  # ended sessions a server keeps for their clients at most
KEPT_SECONDS = 600.0  # and for how long each, unused
LIFETIME_WEIGHT = 0.2  # of the last session in the running mean of how long sessions hold their pages

PREEMPTED = (
    "this session's pages went to an older session that needed them (the server's cache is full): "
    "send its history again, here once there is room or on another server"
)
RECLAIMED = (
    "this session was idle and its pages went to another session: send its history again, here once "
    "there is room or on another server"
)


@dataclass(eq=False)
class Lease:
    """One session's share of the server's cache pages (see the module docstring)."""

    lender: Lender
    number: int  # admission order: later sessions give their pages up first
    admitted: float
    span: Hashable = None  # what a session continuing this one must match: blocks, adapter, batch size
    caches: list = field(default_factory=list)  # the session's caches, one per block
    pages: dict[PageArena, int] = field(default_factory=dict)  # held, per arena
    state: str = LIVE
    last_used: float = 0.0
    key: Hashable = None  # while kept: its client's (peer, key)
    preemption: str | None = None  # why its pages went to another session (its next step says so)

    @property
    def preempted(self) -> bool:
        return self.preemption is not None

    @property
    def total_pages(self) -> int:
        return sum(self.pages.values())

    def took(self, arena: PageArena, count: int) -> None:
        """Its session's pool took ``count`` pages of ``arena`` (under the arena's lock)."""
        self.pages[arena] = self.pages.get(arena, 0) + count
        if self.state in LENT:
            arena.kept_pages += count

    def gave(self, arena: PageArena, count: int) -> None:
        """Its session's pool gave ``count`` pages of ``arena`` back (under the arena's lock)."""
        self.pages[arena] -= count
        if self.state in LENT:
            arena.kept_pages -= count

    def use(self) -> None:
        """Its session is about to compute (``Lender.use``)."""
        self.lender.use(self)


class Lender:
    """The leases of one server's sessions, and who gives pages up when a session needs more."""

    def __init__(
        self,
        lock: threading.RLock,
        clock: Callable[[], float] = time.monotonic,
        max_kept: int = MAX_KEPT_SESSIONS,
        kept_seconds: float = KEPT_SECONDS,
    ) -> None:
        self.lock, self.clock = lock, clock
        self.max_kept, self.kept_seconds = max_kept, kept_seconds
        self._live: dict[Lease, None] = {}  # live and idle, in admission order
        self._lent: dict[Lease, None] = {}  # idle and kept, least recently used first
        self._kept: dict[Hashable, Lease] = {}
        self._numbers = itertools.count(1)
        self.preemptions = 0  # live sessions whose pages went to an older one
        self.reclaimed = 0  # idle or kept sessions whose pages went to another
        self.mean_lifetime: float | None = None  # seconds a session holds its pages, a running mean

    def __len__(self) -> int:
        """Sessions live or idle now."""
        return len(self._live)

    @property
    def kept(self) -> int:
        """Ended sessions kept now."""
        return len(self._kept)

    def admit(self, span: Hashable = None) -> Lease:
        """A lease for a session admitted now (the latest: the first to give its pages up)."""
        with self.lock:
            now = self.clock()
            lease = Lease(self, next(self._numbers), now, span, last_used=now)
            self._live[lease] = None
            return lease

    def use(self, lease: Lease) -> None:
        """``lease``'s session is about to compute: an idle one is live again; one whose pages went to
        another session raises ``SessionPreempted``, saying why."""
        with self.lock:
            if lease.preempted:
                raise SessionPreempted(lease.preemption)
            if lease.state == IDLE:
                self._unlend(lease, LIVE)
            lease.last_used = self.clock()

    def lend(self, lease: Lease) -> int:
        """``lease``'s client went silent: lend its pages until its next step. Returns how many."""
        with self.lock:
            if lease.state != LIVE or not lease.total_pages:
                return 0
            self._lend(lease, IDLE)
            return lease.total_pages

    def keep(self, lease: Lease, key: Hashable) -> int:
        """``lease``'s session ended asking to be kept under ``key`` (its client's): its pages stay, lent,
        for a later session with that key (``resume``). Returns how many pages are kept (0: none were
        held, or the session had lost them)."""
        with self.lock:
            self.expire()
            if lease.state not in (LIVE, IDLE) or not lease.total_pages:
                self._release(lease)
                return 0
            self._note_lifetime(lease)
            if (older := self._kept.get(key)) is not None:
                self._release(older)
            self._live.pop(lease, None)
            if lease.state == IDLE:
                self._unlend(lease, LIVE)
            self._lend(lease, KEPT)
            lease.key, lease.last_used = key, self.clock()
            self._kept[key] = lease
            while len(self._kept) > self.max_kept:  # the least recently used go first
                self._release(next(kept for kept in self._lent if kept.state == KEPT))
            return lease.total_pages

    def resume(self, key: Hashable, span: Hashable) -> Lease | None:
        """The kept session under ``key`` if it matches ``span``, live again as a session admitted now
        (None: no such session, or it was reclaimed)."""
        with self.lock:
            self.expire()
            lease = self._kept.get(key)
            if lease is None or lease.span != span:
                return None
            del self._kept[key]
            self._unlend(lease, LIVE)
            lease.key, lease.number = None, next(self._numbers)
            lease.admitted = lease.last_used = self.clock()
            self._live[lease] = None
            return lease

    def end(self, lease: Lease) -> None:
        """``lease``'s session ended: its pages go back."""
        with self.lock:
            if lease.state in (LIVE, IDLE):
                self._note_lifetime(lease)
            self._release(lease)

    def expire(self) -> None:
        """Release the kept sessions unused for longer than ``kept_seconds``."""
        with self.lock:
            now = self.clock()
            for lease in [
                lease for lease in self._kept.values() if now - lease.last_used > self.kept_seconds
            ]:
                self._release(lease)

    def make_room(self, arena: PageArena, count: int, requester: Lease | None) -> None:
        """Free pages of ``arena`` until ``count`` are: idle and kept leases' first (least recently used
        first), then live ones', the most recently admitted first. Raises ``SessionPreempted`` when that
        is ``requester`` itself; returns with fewer free only when no lease holds any page of ``arena``."""
        with self.lock:
            while arena.free_pages < count:
                lent = next((lease for lease in self._lent if lease.pages.get(arena)), None)
                if lent is not None:
                    self.reclaimed += 1
                    self._release(lent, RECLAIMED)
                    continue
                victim = self._newest_live(arena, requester)
                if victim is None:
                    return
                self.preemptions += 1
                self._release(victim, PREEMPTED)
                if victim is requester:
                    raise SessionPreempted(PREEMPTED)

    def pages(self, arena: PageArena) -> dict[str, int]:
        """``arena``'s pages by use: held by live sessions, lent (idle and kept sessions'), free."""
        with self.lock:
            free, kept = arena.free_pages, arena.kept_pages
            return {"live": arena.num_pages - free - kept, "kept": kept, "free": free}

    def _newest_live(self, arena: PageArena, requester: Lease | None) -> Lease | None:
        candidates = [
            lease
            for lease in self._live
            if lease.state == LIVE and (lease.pages.get(arena) or lease is requester)
        ]
        return max(candidates, key=lambda lease: lease.number, default=None)

    def _lend(self, lease: Lease, state: str) -> None:
        for arena, count in lease.pages.items():
            arena.kept_pages += count
        lease.state = state
        self._lent[lease] = None
        for arena in lease.pages:  # lent pages are available: sessions waiting for admission look again
            for callback in arena.on_free:
                callback()

    def _unlend(self, lease: Lease, state: str) -> None:
        for arena, count in lease.pages.items():
            arena.kept_pages -= count
        lease.state = state
        self._lent.pop(lease, None)

    def _release(self, lease: Lease, preemption: str | None = None) -> None:
        """Give every page of ``lease`` back (``preemption``: why, for its session's next step)."""
        if lease.state == GONE:
            return
        if lease.state in LENT:
            self._unlend(lease, GONE)
        lease.state, lease.preemption = GONE, preemption
        self._live.pop(lease, None)
        if lease.key is not None and self._kept.get(lease.key) is lease:
            del self._kept[lease.key]
        for cache in lease.caches:
            cache.release()

    def _note_lifetime(self, lease: Lease) -> None:
        seconds = self.clock() - lease.admitted
        mean = self.mean_lifetime
        self.mean_lifetime = seconds if mean is None else mean + LIFETIME_WEIGHT * (seconds - mean)
