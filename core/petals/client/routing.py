"""Which servers compute which blocks: the swarm's spans, bans, pings and route choice.

``RemoteSequenceManager`` reads every server's record for the model's blocks from the DHT, keeps
the ONLINE spans (minus banned, blocked or not-allowed peers) and chooses chains of spans:

* ``min_latency`` (inference): the routing policy of ``petals.policies.routing`` (``routing`` in the
  client config: ``ours``, the default, or ``petals22``) over Petals' graph: entering a span costs half
  the client's ping to it plus a per-hop overhead, each block costs ``1/inference_rps``, switching from
  span ``p`` to ``q`` at a boundary costs ``p``'s announced ``next_pings[q]`` / 2 (or half of both client
  pings when unknown), leaving costs half a ping; spans without enough KV cache for the session are
  skipped. ``route_candidates`` builds the policy's input.
* ``max_throughput`` (forward/backward): left to right, a random span containing the current block,
  weighted by its throughput and how many blocks it covers from there.

Where later layers reuse the keys and values an earlier layer computed in the same pass
(``petals.block.closed_boundaries``), both modes cross the boundaries between them on one server: no
hop begins or ends there, and such blocks without one server holding them all are missing blocks,
reported with the command that serves them.

One retry policy serves inference, forward and backward (``handle_failure``, judged by
``judge_failure``): a failure is retried elsewhere only when a retry can fix it, at most ``max_retries``
times, after a backoff with jitter; the server is banned (``ban_timeout`` seconds, doubled after every
failure once its last ban has ended, at most ``MAX_BAN_SECONDS``) only when the failure is its own and
another server can take its blocks: the only server of some blocks is waited for (retried after the
backoff), never banned nor avoided for an earlier ban, since a ban could only turn its stall into an
outage. Requests that were in
flight when a server was banned do not ban it again: one stall is one failure, however many sessions
it hit. A request whose every server of some blocks is banned is refused at once (``RouteBanned``, which
says when the first ban ends) rather than put to sleep for the ban. A request the server refused as
malformed (``bad_request``), or an error of the client itself, is raised at once and bans nobody. A
server's own bug is not a flaky peer: when every server of some blocks answered ``[internal]`` with the
same error (the only one: twice), no ban can help, and ``ServerFailure`` quotes that error at once
instead of waiting the bans out.

Memory is nobody's failure. A server that gave a session's pages to an older session (``[preempted]``)
is replayed the session's history at once, banned by nobody and without a backoff; a server with no
room for a new session now (``[cache_full]``, which says about how long until there is) is not banned
either: routing prefers servers with room for that long (``cache_waits``), and the only server of some
blocks is waited for as long as it said. Sessions are opened with an ``alloc_timeout``
(``server_session``), so they wait in the server's line instead of being refused. Neither counts against
``max_retries``. A server's record announces its cache every minute or so: where no server has room for a
session by their records, routing takes the servers that could hold it once their sessions end (their
line is the wait), so neither a full swarm nor a stale record is reported as missing blocks; only a
session no server could ever hold is.

What the client measured of each server (``measurements.ServerMeasurements``) overrides what the
server announced once it has samples: routes use the measured speed where it is lower, and inference
steps wait for a server as long as its observed latency (or, for a server never timed, its announced
speed bounded by other servers of the same blocks) says they should, so a hung server is routed
around in seconds rather than after ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID

from petals.block import closed_boundaries
from petals.client.measurements import ServerMeasurements
from petals.client.suspects import Suspects
from petals.data_structures import RemoteSpanInfo, ServerState, make_uids
from petals.dht import compute_spans, get_remote_module_infos
from petals.kv_cache import check_span
from petals.membership import PRIVATE_SWARM_HINT, MembershipError, SwarmMembership
from petals.network.client import ClientNetwork
from petals.network.rpc import ping
from petals.policies import ROUTINGS, RouteCandidates, shared_groups
from petals.wire_errors import cut, error_kind

logger = logging.getLogger(__name__)

DEFAULT_INFERENCE_RPS = 300.0
UNKNOWN_RTT = 0.15
MAX_RTT = 5.0


class MissingBlocksError(RuntimeError):
    """Some blocks have no usable server in the swarm."""


class RequestRefused(ValueError):
    """A server refused the request itself (``bad_request``): sending it elsewhere cannot help."""


class ServerMisbehaved(RuntimeError):
    """A server answered something that does not fit the request (wrong shapes, tensor counts)."""


class RouteBanned(MissingBlocksError):
    """Every server of some blocks failed lately and is banned: the request is refused at once, and
    ``retry_after`` (seconds) says when the first of those bans ends."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServerFailure(RuntimeError):
    """Every server of some blocks fails with the same ``[internal]`` error: the servers' bug, not the network."""


# a server's [internal] errors count together only this long (a success forgets them sooner)
SAME_FAILURE_SECONDS = 120.0
# the longest ban, however often a server failed: a server back from a stall is used again within a minute
MAX_BAN_SECONDS = 60.0


# failures that are the server's (or the network's), and that another server may not have
SERVER_FAULTS = (TimeoutError, OSError, EOFError, StopAsyncIteration, P2PDaemonError, ServerMisbehaved)


class Verdict(NamedTuple):
    """What ``judge_failure`` decides about a failed request."""

    retry: bool
    ban: bool
    # seconds to wait before the retry, for a failure that is nobody's (memory): it does not count against
    # max_retries; None for a failure, retried after the backoff
    wait: float | None = None


# a [cache_full] refusal says so for a session larger than the server's whole cache (a permanent refusal),
# and how long until there is room for one that only has to wait
NEVER_FITS = "whole budget"
ROOM_IN = re.compile(r"expect room in about (\d+(?:\.\d+)?) s")
# how long a server out of room is waited for (or avoided) when it names no time, and at most
CACHE_RETRY_SECONDS = 1.0
MAX_CACHE_WAIT = 30.0


def cache_wait(error: BaseException) -> float | None:
    """Seconds until ``error``'s server expects room, if ``error`` says it has none for the session now
    (``[cache_full]``, or ``[preempted]``: it just gave the session's pages away); None for anything else,
    a session that can never fit there included."""
    if not isinstance(error, P2PHandlerError):
        return None
    text = str(error)
    kind = error_kind(text)
    if kind == "preempted":
        return CACHE_RETRY_SECONDS
    if kind != "cache_full" or NEVER_FITS in text:
        return None
    named = ROOM_IN.search(text)
    return min(float(named.group(1)), MAX_CACHE_WAIT) if named else CACHE_RETRY_SECONDS


def judge_failure(error: BaseException, only_server: bool = False) -> Verdict:
    """Retry, ban the server, and how long to wait, for a failed request; see the module docstring.
    ``only_server``: no other server holds some of the failed server's blocks
    (``RemoteSequenceManager.only_server``): it is waited for, not banned."""
    if isinstance(error, P2PHandlerError):
        kind = error_kind(str(error))
        if kind == "bad_request":
            return Verdict(False, False)
        if kind == "preempted":  # replayed at once: here, in the server's line, or where there is room
            return Verdict(True, False, 0.0)
        room = cache_wait(error)
        if room is not None:  # waited for where it is alone, else routed to servers with room meanwhile
            return Verdict(True, False, room if only_server else 0.0)
        if kind == "cache_full":  # the session can never fit this server: another one, if there is any
            return Verdict(not only_server, not only_server)
        own = kind != "not_served"  # untagged: a stock Petals server, judged as before
    elif isinstance(error, SERVER_FAULTS):
        own = True
    else:
        return Verdict(False, False)
    return Verdict(True, own and not only_server)


def ban_seconds(ban_timeout: float, failures: int) -> float:
    """How long a server is banned after its ``failures``-th failure in a row: doubled each time, capped."""
    return min(ban_timeout * 2.0 ** min(failures - 1, 64), MAX_BAN_SECONDS)


@dataclass
class _Ban:
    until: float
    failures: int


@dataclass
class _InternalError:
    """The last ``[internal]`` error text a server answered, how many times in a row, and when."""

    text: str
    times: int
    at: float


def internal_error_text(error: BaseException) -> str | None:
    """The server's own words (from its ``[internal]`` tag on) if ``error`` is a server's internal failure."""
    if not isinstance(error, P2PHandlerError):
        return None
    text = " ".join(str(error).split())  # one line, whatever the server's message holds
    start = text.find("[internal] ")
    return text[start:] if start >= 0 and error_kind(text) == "internal" else None


class RemoteSequenceManager:
    """The client's view of the servers hosting ``{dht_prefix}.0`` … ``{dht_prefix}.{num_blocks-1}``."""

    def __init__(self, config, network: ClientNetwork, num_blocks: int) -> None:
        self.config = config
        self.network = network
        self.dht_prefix: str = config.dht_prefix
        self.block_uids = make_uids(self.dht_prefix, 0, num_blocks)
        self.closed = closed_boundaries(config)  # where a chain may not switch servers
        self.online_spans: dict[PeerID, RemoteSpanInfo] = {}  # every usable ONLINE server
        self.spans: dict[PeerID, RemoteSpanInfo] = {}  # those of them with the active adapter
        self.pings: dict[PeerID, float] = {}
        self.bans: dict[PeerID, _Ban] = {}
        self.internal_errors: dict[PeerID, _InternalError] = {}
        self.cache_waits: dict[PeerID, float] = {}  # servers out of room, and until when (monotonic)
        self.last_update = -float("inf")
        self.measurements = ServerMeasurements(config.min_step_timeout, config.request_timeout)
        self.suspects = Suspects()  # caught lying by ``verification``: banned for good
        self.routing = ROUTINGS[getattr(config, "routing", "ours")]()
        self.routing_rng = np.random.default_rng()
        self._refreshing: asyncio.Future | None = None  # a background read of revocations, referenced
        self._refreshed = -float("inf")

    def __len__(self) -> int:
        return len(self.block_uids)

    def chain_uid(self, start: int, end: int) -> str:
        return " ".join(self.block_uids[start:end])

    # ---- the swarm's state ---------------------------------------------------------------------

    async def update(self) -> None:
        """Re-read the DHT records (and a private swarm's revocations), keep the servers this client may
        use, and ping those not reached yet: every one, since a server is used only once it answered."""
        membership = self.network.membership
        refreshing = membership.refresh(self.network.node) if membership is not None else asyncio.sleep(0)
        infos, _ = await asyncio.gather(
            get_remote_module_infos(self.network.node, self.block_uids, latest=True), refreshing
        )
        if membership is not None and membership.own_problem() is not None:
            raise MembershipError(membership.own_problem())
        spans = compute_spans(infos, min_state=ServerState.ONLINE)
        eligible = self.eligible(spans)
        self.online_spans = {peer: span for peer, span in spans.items() if peer in eligible}
        adapter = self.config.active_adapter
        self.spans = {
            peer: span
            for peer, span in self.online_spans.items()
            if not adapter or adapter in span.server_info.adapters
        }
        self.last_update = time.monotonic()
        # fake records of peers that do not exist or answer must not cost a failed request each:
        # they fail their ping (at once, or after ping_timeout, all at the same time) and stay unused
        unreached = [peer for peer in self.spans if math.isinf(self.pings.get(peer, math.inf))]
        rtts = await asyncio.gather(
            *(ping(self.network.p2p, peer, self.config.ping_timeout) for peer in unreached)
        )
        self.pings.update(zip(unreached, rtts, strict=True))

    def eligible(self, spans: dict[PeerID, RemoteSpanInfo]) -> set[PeerID]:
        """The servers this client may use at all, the one place that decides: ``allowed_servers``,
        ``blocked_servers`` and, in a private swarm, a valid server certificate (``petals.membership``)."""
        allowed = _peer_set(self.config.allowed_servers)
        blocked = _peer_set(self.config.blocked_servers) or set()
        membership = self.network.membership
        return {
            peer
            for peer in spans
            if (allowed is None or peer in allowed)
            and peer not in blocked
            and (membership is None or membership.is_server(peer))
        }

    def may_use(self, peer: PeerID) -> bool:
        """Whether a route chosen earlier may still use ``peer``: of ``eligible``'s rules, only a private
        swarm's certificate can change after the choice (it may have been revoked or have expired since)."""
        membership = self.network.membership
        return membership is None or membership.is_server(peer)

    async def ensure_fresh(self) -> None:
        if time.monotonic() - self.last_update > self.config.update_period:
            await self.update()

    def refresh_membership_in_background(self) -> None:
        """In a private swarm, re-read the revocation list once an update period has passed, without
        waiting for it: an open session's steps call this, so that a revocation reaches routes chosen
        before it (``may_use``) while steps go on."""
        membership, now = self.network.membership, time.monotonic()
        if (
            membership is None
            or self._refreshing is not None
            or now - self._refreshed < self.config.update_period
        ):
            return
        self._refreshed = now  # when it was started: a failing read is not retried before a period either
        self._refreshing = asyncio.ensure_future(self._refresh_membership(membership))

    async def _refresh_membership(self, membership: SwarmMembership) -> None:
        try:
            await membership.refresh(self.network.node)
        except Exception as error:  # the next period tries again; the list in use stays
            logger.debug("Could not refresh the revocation list: %s", error)
        finally:
            self._refreshing = None

    def usable_spans(self) -> list[RemoteSpanInfo]:
        """Spans of servers that are neither banned nor known to be unreachable. A ban only steers routes
        to other servers: the only server of some blocks is used, banned or not (unless caught lying)."""
        now = time.monotonic()
        return [
            span
            for peer, span in self.spans.items()
            if not self._is_unreachable(peer)
            and (not self._is_banned(peer, now) or (peer not in self.suspects and self.only_server(peer)))
        ]

    def _is_unreachable(self, peer: PeerID) -> bool:
        return math.isinf(self.pings.get(peer, 0.0))

    def _is_banned(self, peer: PeerID, now: float) -> bool:
        ban = self.bans.get(peer)
        return peer in self.suspects or (ban is not None and ban.until > now)

    def on_request_failure(self, peer: PeerID | None) -> None:
        """Ban ``peer`` (``ban_seconds``); a failure while it is banned already came from a request sent
        before the ban (the same stall) and changes nothing."""
        if peer is None:
            return
        now = time.monotonic()
        ban = self.bans.get(peer)
        if ban is not None and ban.until > now:
            return
        failures = ban.failures + 1 if ban is not None else 1
        duration = ban_seconds(self.config.ban_timeout, failures)
        self.bans[peer] = _Ban(now + duration, failures)
        logger.warning("Server %s failed; not using it for %.0f s", peer, duration)

    def only_server(self, peer: PeerID) -> bool:
        """Whether no other server holds some block of ``peer``'s span (banned ones count: their bans end;
        unreachable ones and those caught lying do not): then routing around ``peer`` is impossible, and a
        failure of it is waited out instead of banned."""
        span = self.spans.get(peer) or self.online_spans.get(peer)
        if span is None:
            return False
        covered = set()
        for other, other_span in self.spans.items():
            if other != peer and other not in self.suspects and not self._is_unreachable(other):
                covered.update(range(max(other_span.start, span.start), min(other_span.end, span.end)))
        return len(covered) < span.length

    async def _alone(self, peer: PeerID | None) -> bool:
        """``only_server(peer)``, as the DHT says now: where it looks alone, the records are read again
        first (a replacement may have joined since they were read: then it is routed around, not waited for)."""
        if peer is None or not self.only_server(peer):
            return False
        await self.update()
        return self.only_server(peer)

    def on_request_success(self, peer: PeerID) -> None:
        self.internal_errors.pop(peer, None)
        ban = self.bans.get(peer)
        if ban is not None and ban.until <= time.monotonic():
            del self.bans[peer]

    def retry_delay(self, attempt: int) -> float:
        """0 for the first retry, then ``min_backoff · 2^(attempt-1)`` capped at ``max_backoff``, with
        jitter (50-100% of it) so that clients failed by the same server do not retry in lockstep."""
        if attempt == 0:
            return 0.0
        delay = min(self.config.min_backoff * 2 ** (attempt - 1), self.config.max_backoff)
        return delay * random.uniform(0.5, 1.0)

    def check_retries(self, attempt: int, error: BaseException) -> None:
        if self.config.max_retries is not None and attempt >= self.config.max_retries:
            raise error

    async def handle_failure(self, error: BaseException, peer: PeerID | None, attempt: int) -> Verdict:
        """Raise ``error`` if retrying cannot fix it or retries are used up; else ban ``peer`` if the
        failure was its own and another server holds its blocks, and wait the backoff (or, for a cache
        wait, the time ``judge_failure`` says) before the caller's next attempt. Returns the verdict."""
        # whether the server is alone matters only where it changes the verdict
        alone = judge_failure(error, True) != judge_failure(error, False) and await self._alone(peer)
        verdict = judge_failure(error, only_server=alone)
        if not verdict.retry:
            if isinstance(error, P2PHandlerError):
                raise RequestRefused(f"a server refused the request: {error}") from error
            raise error
        text = internal_error_text(error)
        if text is not None and peer is not None:
            self._note_internal_error(peer, text, error)
        if verdict.wait is not None:  # memory: nobody's failure
            self._note_cache_wait(peer, error)
            await asyncio.sleep(verdict.wait * random.uniform(0.5, 1.0))
            return verdict
        self.check_retries(attempt, error)
        if verdict.ban:
            self.on_request_failure(peer)
        else:
            self.last_update = -float("inf")  # e.g. the server moved: read the DHT again
        await asyncio.sleep(self.retry_delay(attempt))
        return verdict

    def _note_cache_wait(self, peer: PeerID | None, error: BaseException) -> None:
        """Routing prefers other servers to ``peer`` until it expects room (``cache_wait``)."""
        room = cache_wait(error)
        if peer is not None and room is not None:
            self.cache_waits[peer] = time.monotonic() + room

    def _note_internal_error(self, peer: PeerID, text: str, error: BaseException) -> None:
        """Remember ``peer``'s ``[internal]`` error; raise ``ServerFailure`` when every server of some of
        its blocks failed so (the only one: twice, as its first such error is retried: it may have passed)."""
        now = time.monotonic()
        times = self.internal_errors[peer].times + 1 if self._failed_with(peer, text, now) else 1
        self.internal_errors[peer] = _InternalError(text, times, now)
        span = self.spans.get(peer) or self.online_spans.get(peer)
        if span is None:
            return
        failing = []
        for block in range(span.start, span.end):
            servers = [
                other
                for other, other_span in self.spans.items()
                if other_span.start <= block < other_span.end
                and other not in self.suspects
                and not self._is_unreachable(other)
            ]
            if all(self._failed_with(other, text, now) for other in servers) and (
                len(servers) > 1 or times >= 2
            ):
                failing.append(block)
        if failing:
            raise ServerFailure(
                f"every server of blocks {_ranges(failing)} (dht_prefix {self.dht_prefix!r}) fails with the "
                f"same error, a bug of the servers rather than of the network: {cut(text, 500)}. Its operator "
                "finds the traceback in the server's log; until it is fixed, serve these blocks with a server "
                "that works"
            ) from error

    def _failed_with(self, peer: PeerID, text: str, now: float) -> bool:
        record = self.internal_errors.get(peer)
        return record is not None and record.text == text and now - record.at < SAME_FAILURE_SECONDS

    # ---- routes --------------------------------------------------------------------------------

    async def make_sequence(
        self, start: int, end: int, *, mode: str, cache_tokens_needed: int | None = None
    ) -> list[RemoteSpanInfo]:
        """A chain of spans covering blocks ``[start, end)``; refreshes the swarm's state when needed.
        Raises ``MissingBlocksError`` at once where no usable server holds some block (``RouteBanned``
        where that is only for now: every server of it is banned)."""
        await self.ensure_fresh()
        try:
            return self._choose(start, end, mode, cache_tokens_needed)
        except MissingBlocksError:
            await self.update()
        return self._choose(start, end, mode, cache_tokens_needed)

    def _choose(
        self, start: int, end: int, mode: str, cache_tokens_needed: int | None
    ) -> list[RemoteSpanInfo]:
        spans = self.measurements.measured_spans(self.usable_spans())
        if cache_tokens_needed is not None:
            spans = self._with_room(spans, start, end, cache_tokens_needed)
        check_span(self.closed, start, end)
        self._check_coverage(spans, start, end, cache_tokens_needed)
        self._check_shared_groups(spans, start, end)
        if mode == "min_latency":
            route = self._min_latency(spans, start, end)
        elif mode == "max_throughput":
            route = _max_throughput(spans, start, end, self.closed)
        else:
            raise ValueError(f"unknown routing mode {mode!r}; use 'min_latency' or 'max_throughput'")
        if self.config.show_route is True or (
            self.config.show_route == "inference" and mode == "min_latency"
        ):
            logger.info(
                "Route: %s",
                " => ".join(f"{span.start}:{span.end} via …{str(span.peer_id)[-6:]}" for span in route),
            )
        return route

    def _with_room(
        self, spans: Sequence[RemoteSpanInfo], start: int, end: int, tokens: int
    ) -> list[RemoteSpanInfo]:
        """The spans whose servers have room for a session of ``tokens`` tokens by their records (and did
        not just refuse one), and, for the blocks none of those holds, the servers that could hold it once
        their sessions end: the session waits in their line (a record is up to a minute old, and a full
        swarm frees memory as sessions end). A cache wait is never a missing block."""
        now = time.monotonic()
        roomy = [
            span
            for span in spans
            if _has_cache_for(span, tokens) and self.cache_waits.get(span.peer_id, 0.0) <= now
        ]
        covered = {block for span in roomy for block in range(span.start, span.end)}
        waiting = [
            span
            for span in spans
            if span not in roomy
            and _could_hold(span, tokens)
            and any(block not in covered for block in range(max(span.start, start), min(span.end, end)))
        ]
        return roomy + waiting

    def _check_coverage(
        self, spans: Sequence[RemoteSpanInfo], start: int, end: int, cache_tokens_needed: int | None
    ) -> None:
        covered = set()
        for span in spans:
            covered.update(range(span.start, span.end))
        missing = [block for block in range(start, end) if block not in covered]
        if not missing:
            return
        first, adapter = missing[0], self.config.active_adapter
        hosting = [span for span in self.online_spans.values() if span.start <= first < span.end]
        with_adapter = [span for span in hosting if span.peer_id in self.spans]
        if hosting and not with_adapter:
            offered = sorted({name for span in hosting for name in span.server_info.adapters})
            raise MissingBlocksError(
                f"no server for block {self.block_uids[first]} has the adapter {adapter!r} (active_adapter); "
                f"its {len(hosting)} server(s) offer {', '.join(map(repr, offered)) or 'no adapters'}. "
                f"Start a server with `--adapters {adapter}` for blocks {_ranges(missing)}, "
                "or choose another active_adapter."
            )
        if not hosting and self.network.membership is None and self.network.private_swarm.seen:
            raise MissingBlocksError(f"no server for block {self.block_uids[first]}: {PRIVATE_SWARM_HINT}")
        if not hosting:
            reason = "no ONLINE server announces it in the DHT"
        elif cache_tokens_needed is not None and not any(
            _could_hold(span, cache_tokens_needed) for span in with_adapter
        ):
            reason = (
                f"no server has KV cache left for a session of {cache_tokens_needed} tokens, nor would have "
                "once its sessions end (use a shorter max_length)"
            )
        elif all(self._is_unreachable(span.peer_id) for span in with_adapter):
            reason = (
                "none of its servers answered a ping: they are unreachable from here, or refuse this "
                "client (a private swarm serves only peers started with --membership)"
            )
        elif all(span.peer_id in self.suspects for span in with_adapter):
            reason = (
                "its servers returned wrong outputs (caught by verification): this client uses them no more"
            )
        else:
            self._refuse_banned(first, with_adapter)
            reason = "its servers are unreachable or returned wrong outputs"
        raise MissingBlocksError(
            f"no server for block {self.block_uids[first]} (dht_prefix {self.dht_prefix!r}, blocks missing: "
            f"{_ranges(missing)}): {reason}. Start a server for these blocks, e.g. "
            f"`petals serve <model> --block_indices {first}:{missing[-1] + 1}`, or check the dht_prefix."
        )

    def _refuse_banned(self, block: int, hosting: Sequence[RemoteSpanInfo]) -> None:
        """Raise ``RouteBanned`` for ``block`` if some server ``hosting`` it is only banned for now."""
        now = time.monotonic()
        ends = [
            self.bans[span.peer_id].until
            for span in hosting
            if span.peer_id in self.bans
            and span.peer_id not in self.suspects
            and not self._is_unreachable(span.peer_id)
            and self.bans[span.peer_id].until > now
        ]
        if not ends:
            return
        retry_after = min(ends) - now
        raise RouteBanned(
            f"no server for block {self.block_uids[block]} (dht_prefix {self.dht_prefix!r}) is usable now: "
            f"every server hosting it failed in the last minute and is banned for now; retry in "
            f"{math.ceil(retry_after)} s, when the first ban ends",
            retry_after,
        )

    def _check_shared_groups(self, spans: Sequence[RemoteSpanInfo], start: int, end: int) -> None:
        """Every block has a server (``_check_coverage``), so a chain exists unless some blocks that share
        keys and values, which a chain crosses on one server, have no server holding them all."""
        for group in shared_groups(self.closed):
            inside = start <= group.start and group.stop <= end
            if inside and not any(span.start <= group.start and group.stop <= span.end for span in spans):
                raise MissingBlocksError(
                    f"blocks {group.start}:{group.stop} share keys and values and must be served by one "
                    f"server, but no server usable now holds them all (dht_prefix {self.dht_prefix!r}). "
                    f"Start one, e.g. `petals serve <model> --block_indices {group.start}:{group.stop}` "
                    "(or a span holding it)"
                )

    def _rtt(self, peer: PeerID) -> float:
        return min(self.pings.get(peer, UNKNOWN_RTT), MAX_RTT)

    def route_candidates(self, spans: Sequence[RemoteSpanInfo]) -> RouteCandidates:
        """The one place where the client turns the spans it may use into the routing policy's input:
        its pings, each server's seconds per block and the pings servers announce to each other (a hop
        without an announced ping goes via the client: half of both client pings)."""
        rtts = np.array([self._rtt(span.peer_id) for span in spans], dtype=float)
        hops = (rtts[:, None] + rtts[None, :]) / 2
        names = [span.peer_id.to_base58() for span in spans]
        for row, span in enumerate(spans):
            announced = span.server_info.next_pings or {}
            for column, name in enumerate(names):
                if name in announced:
                    hops[row, column] = min(announced[name], MAX_RTT) / 2
        steps = [1 / (span.server_info.inference_rps or DEFAULT_INFERENCE_RPS) for span in spans]
        return RouteCandidates(
            starts=np.array([span.start for span in spans], dtype=int),
            ends=np.array([span.end for span in spans], dtype=int),
            step_seconds=np.array(steps, dtype=float),
            client_rtt=rtts,
            sites=np.arange(len(spans)),
            hop_seconds=hops,
            closed=self.closed,
        )

    def _min_latency(self, spans: Sequence[RemoteSpanInfo], start: int, end: int) -> list[RemoteSpanInfo]:
        chosen = self.routing.route(self.route_candidates(spans), start, end, self.routing_rng)
        return [
            RemoteSpanInfo(spans[i].peer_id, first, stop, spans[i].server_info) for i, first, stop in chosen
        ]

    def push_pays(self, span: RemoteSpanInfo, next_peer: PeerID) -> bool:
        """Whether ``span``'s server reaches ``next_peer`` sooner than the client's own copy would.

        A push takes half the sender's announced ping to the next server; the client's copy takes half
        the client's ping to the sender plus half its ping to the next server. Unknown announced pings
        count as paying, as in Petals: a copy that arrives second is dropped before it is decoded.
        """
        announced = (span.server_info.next_pings or {}).get(next_peer.to_base58())
        return announced is None or announced < self._rtt(span.peer_id) + self._rtt(next_peer)


def _max_throughput(
    spans: Sequence[RemoteSpanInfo], start: int, end: int, closed: frozenset[int] = frozenset()
) -> list[RemoteSpanInfo]:
    """A hop from ``block`` on a span ends at its farthest boundary that is not ``closed``; spans with
    none past ``block`` are no candidates. Once ``_choose``'s checks pass, some span always is one: a
    chain over ``[start, end)`` crosses every boundary it reaches on a span that also serves from there."""
    route, block = [], start
    while block < end:
        candidates = [span for span in spans if span.start <= block < span.end]
        hops = [(span, _hop_end(block, min(span.end, end), closed)) for span in candidates]
        hops = [(span, stop) for span, stop in hops if stop > block]
        weights = [max(span.throughput, 1e-6) * (stop - block) for span, stop in hops]
        chosen, stop = random.choices(hops, weights=weights)[0]
        route.append(RemoteSpanInfo(chosen.peer_id, block, stop, chosen.server_info))
        block = stop
    return route


def _hop_end(block: int, limit: int, closed: frozenset[int]) -> int:
    """The farthest boundary in ``(block, limit]`` that is not ``closed``; ``block`` itself if none is."""
    while limit > block and limit in closed:
        limit -= 1
    return limit


def _has_cache_for(span: RemoteSpanInfo, tokens: int) -> bool:
    """Petals' rule: keys and values are counted separately in ``cache_tokens_left``."""
    left = span.server_info.cache_tokens_left
    return left is None or tokens * 2 * span.length <= left


def _could_hold(span: RemoteSpanInfo, tokens: int) -> bool:
    """Whether ``span``'s server could hold a session of ``tokens`` tokens once its sessions end, as far as
    its record tells: a record announced while no session was live states its whole cache; any other is
    given the benefit of the doubt (the server itself refuses a session larger than its whole cache)."""
    pages = span.server_info.cache_pages
    if pages is None or pages.get("live", 0) > 0:
        return True
    return _has_cache_for(span, tokens)


def _peer_set(peers: Sequence[str | PeerID] | None) -> set[PeerID] | None:
    if peers is None:
        return None
    return {peer if isinstance(peer, PeerID) else PeerID.from_base58(str(peer)) for peer in peers}


def _ranges(blocks: Sequence[int]) -> str:
    groups = []
    for _, run in itertools.groupby(enumerate(blocks), key=lambda item: item[1] - item[0]):
        run = [block for _, block in run]
        groups.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(groups)
