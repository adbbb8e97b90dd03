"""The discrete-event simulation of one swarm under one pair of policies (placement, routing).

Servers join (choosing blocks with the placement policy), load, serve, check their balance at the
policy's random periods, move, leave (OFFLINE) or crash (their records linger for ``record_lingers``).
Clients open inference sessions one after another: each routes with the routing policy over the records
it sees (minus servers it banned, minus servers without KV cache for the session) and pays, per token,
the network delays of its route plus each server's compute, slowed by the other sessions it serves.
A session whose server is gone pays ``failover_seconds`` and routes its remaining tokens again.

Randomness: the trace (hardware, regions, lifetimes, crashes, sessions) comes from streams seeded by
``(seed, server or client)``, so both policies see the same trace; the policies draw from their own.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from petals.policies.placement import MoveHistory, Placement, SwarmView, block_sums
from petals.policies.routing import RouteCandidates, Routing
from petals.simulate.scenario import Scenario

NO_RECORD, JOINING, ONLINE = 0, 1, 2
RETRY_SECONDS = 30.0  # a client that finds no route tries again after this


@dataclass
class Session:
    tokens: int
    started: float
    tokens_left: float = 0.0
    route: list[tuple[int, int, int]] = field(default_factory=list)  # (server slot, start, end)
    seconds_per_token: float = 0.0
    segment_started: float = 0.0
    epoch: int = 0


@dataclass
class Metrics:
    """Accumulated after the warm-up: time integrals, samples and counters."""

    seconds: float = 0.0
    covered_seconds: float = 0.0
    throughput_integral: float = 0.0
    bound_integral: float = 0.0
    server_seconds: float = 0.0
    moves: int = 0
    returns_within_check_period: int = 0
    latencies: list[float] = field(default_factory=list)
    routing_seconds: list[float] = field(default_factory=list)
    routing_cpu_seconds: list[float] = field(default_factory=list)  # the same, in this thread's CPU time
    failovers: int = 0
    series: dict[str, list[float]] = field(
        default_factory=lambda: {
            "hours": [],
            "coverage": [],
            "throughput": [],
            "bound": [],
            "latency_p50": [],
        }
    )


class SimulatedSwarm:
    def __init__(self, scenario: Scenario, placement: Placement, routing: Routing) -> None:
        self.scenario, self.placement, self.routing = scenario, placement, routing
        self.policy_rng = np.random.default_rng([scenario.seed, 7])
        self.now, self.warmup = 0.0, scenario.warmup_seconds
        self.metrics = Metrics()
        self.events: list[tuple] = []
        self.sequence = itertools.count()
        capacity = int(scenario.servers * (1 + 1.5 * scenario.churn * scenario.hours)) + 64
        self.count = 0
        self.gpu = np.zeros(capacity, int)
        self.region = np.zeros(capacity, int)
        self.jitter = np.zeros(capacity)
        self.starts = np.zeros(capacity, int)
        self.ends = np.ones(capacity, int)
        self.state = np.zeros(capacity, int)
        self.alive = np.zeros(capacity, bool)
        self.sessions = np.zeros(capacity, int)
        self.cache_left = np.zeros(capacity)
        self.epoch = np.zeros(capacity, int)
        self.history: dict[int, MoveHistory] = {}
        gpus = scenario.gpus
        self.max_blocks = np.array([min(gpu.max_blocks, scenario.blocks) for gpu in gpus])
        self.forward_rps = np.array([gpu.forward_rps for gpu in gpus])
        self.inference_rps = np.array([gpu.inference_rps for gpu in gpus])
        self.cache_tokens = np.array(
            [
                gpu.cache_sessions * scenario.session_tokens_max * 2.0 * m
                for gpu, m in zip(gpus, self.max_blocks, strict=True)
            ]
        )
        self.rtt = np.array(scenario.rtt_ms, float) / 1000
        self.hop_overhead = scenario.hop_overhead_ms / 1000
        self.listed = scenario.server_kinds  # (GPU kind, region) of each listed server, in join order
        self.client_region = np.zeros(scenario.clients, int)
        self.client_rngs: list[np.random.Generator] = []
        self.bans: list[dict[int, float]] = [{} for _ in range(scenario.clients)]
        self.active: dict[int, Session] = {}
        self.users: dict[int, set[int]] = {}  # server slot -> clients whose route crosses it
        self.version, self._view_cache = 0, None
        self.last_change = 0.0

    # ---- the event loop ------------------------------------------------------------------------

    def push(self, at: float, kind: str, *args) -> None:
        heapq.heappush(self.events, (at, next(self.sequence), kind, args))

    def run(self) -> Metrics:
        s = self.scenario
        rng = np.random.default_rng([s.seed, 1])
        for index in range(s.servers):
            at = float(rng.uniform(0, s.ramp_seconds))
            self.push(index * s.ramp_seconds / s.servers if self.listed else at, "join")
        shares = np.array([region.client_share for region in s.regions])
        for client in range(s.clients):
            client_rng = np.random.default_rng([s.seed, 2, client])
            self.client_rngs.append(client_rng)
            self.client_region[client] = client_rng.choice(len(shares), p=shares / shares.sum())
            if s.client_region is not None:
                self.client_region[client] = [region.name for region in s.regions].index(s.client_region)
            self.push(s.ramp_seconds + float(client_rng.uniform(0, s.think_seconds)), "session", client)
        self.push(self.warmup, "sample")
        end = s.hours * 3600
        handlers = {
            "join": self.on_join,
            "online": self.on_online,
            "check": self.on_check,
            "depart": self.on_depart,
            "expire": self.on_expire,
            "session": self.on_session,
            "session_end": self.on_session_end,
            "sample": self.on_sample,
        }
        while self.events and self.events[0][0] <= end:
            at, _, kind, args = heapq.heappop(self.events)
            self.now = at
            handlers[kind](*args)
        self.account(end)
        return self.metrics

    # ---- servers -------------------------------------------------------------------------------

    def on_join(self) -> None:
        s, slot = self.scenario, self.count
        self.count += 1
        rng = np.random.default_rng([s.seed, 3, slot])
        gpu_shares = np.array([gpu.share for gpu in s.gpus])
        region_shares = np.array([region.server_share for region in s.regions])
        self.gpu[slot] = rng.choice(len(gpu_shares), p=gpu_shares / gpu_shares.sum())
        self.region[slot] = rng.choice(len(region_shares), p=region_shares / region_shares.sum())
        if self.listed:  # a listed server's replacement is of the same kind, in the same region
            self.gpu[slot], self.region[slot] = self.listed[slot % len(self.listed)]
        self.jitter[slot] = rng.uniform(0, s.server_rtt_jitter_ms) / 1000
        lifetime = rng.exponential(3600 / s.churn) if s.churn > 0 else np.inf
        crash = bool(rng.random() < s.crash_fraction)
        self.push(self.now + lifetime, "depart", slot, crash, float(rng.exponential(s.rejoin_seconds)))
        view, _ = self.view()
        blocks = self.placement.choose_blocks(view, int(self.max_blocks[self.gpu[slot]]))
        self.alive[slot] = True
        self.history[slot] = MoveHistory()
        self.cache_left[slot] = (
            self.cache_tokens[self.gpu[slot]] * len(blocks) / self.max_blocks[self.gpu[slot]]
        )
        self.load(slot, blocks, s.startup_seconds)

    def load(self, slot: int, blocks: range, extra_seconds: float = 0.0) -> None:
        self.change()
        self.starts[slot], self.ends[slot], self.state[slot] = blocks.start, blocks.stop, JOINING
        self.epoch[slot] += 1
        seconds = extra_seconds + self.scenario.load_seconds_per_block * len(blocks)
        self.push(self.now + seconds, "online", slot, int(self.epoch[slot]))

    def on_online(self, slot: int, epoch: int) -> None:
        if epoch != self.epoch[slot] or not self.alive[slot]:
            return
        self.change()
        self.state[slot] = ONLINE
        self.push(self.now + self.placement.check_delay(self.policy_rng), "check", slot, epoch)

    def on_check(self, slot: int, epoch: int) -> None:
        if epoch != self.epoch[slot] or not self.alive[slot]:
            return
        view, positions = self.view()
        levels = self._view_cache[2]
        decision = self.placement.choose_new_blocks(
            view,
            positions[slot],
            now=self.now,
            rng=self.policy_rng,
            history=self.history[slot],
            levels=levels,
        )
        if decision.blocks is None:
            self.push(self.now + self.placement.check_delay(self.policy_rng), "check", slot, epoch)
            return
        old = range(int(self.starts[slot]), int(self.ends[slot]))
        history = self.history[slot]
        if self.now >= self.warmup:
            self.metrics.moves += 1
            if (
                decision.blocks == history.left
                and self.now - history.left_at < self.placement.mean_check_period
            ):
                self.metrics.returns_within_check_period += 1
        self.history[slot] = MoveHistory(old, self.now)
        self.evict(slot, failover=False)
        self.load(slot, decision.blocks)

    def on_depart(self, slot: int, crash: bool, rejoin_after: float) -> None:
        self.change()
        self.alive[slot] = False
        self.epoch[slot] += 1
        if crash:
            self.push(self.now + self.scenario.record_lingers, "expire", slot)
        else:
            self.state[slot] = NO_RECORD
        self.evict(slot, failover=crash)
        self.push(self.now + rejoin_after, "join")

    def on_expire(self, slot: int) -> None:
        self.change()
        self.state[slot] = NO_RECORD

    def view(self) -> tuple[SwarmView, np.ndarray]:
        """The placement policy's input: every JOINING or ONLINE record (crashed servers' included)."""
        if self._view_cache is None or self._view_cache[3] != self.version:
            slots = np.flatnonzero(self.state[: self.count] >= JOINING)
            lengths = self.ends[slots] - self.starts[slots]
            forward = self.forward_rps[self.gpu[slots]]
            view = SwarmView(
                self.scenario.blocks,
                self.starts[slots],
                self.ends[slots],
                forward / ((lengths + 1) / 2),
                forward,
            )
            positions = np.full(self.count, -1)
            positions[slots] = np.arange(len(slots))
            self._view_cache = (view, positions, self.placement.levels(view), self.version)
        return self._view_cache[0], self._view_cache[1]

    # ---- clients -------------------------------------------------------------------------------

    def on_session(self, client: int) -> None:
        s, rng = self.scenario, self.client_rngs[client]
        tokens = int(rng.integers(s.session_tokens_min, s.session_tokens_max + 1))
        session = Session(tokens, self.now, tokens_left=tokens)
        self.active[client] = session
        self.start_segment(client, session, penalty=0.0)

    def start_segment(self, client: int, session: Session, penalty: float) -> None:
        route = self.route_for(client, session)
        if route is None:
            del self.active[client]
            self.push(self.now + RETRY_SECONDS, "session", client)
            return
        session.route, session.epoch = route, session.epoch + 1
        for slot, start, end in route:
            self.sessions[slot] += 1
            self.cache_left[slot] -= self.cache_need(session, end - start)
            self.users.setdefault(slot, set()).add(client)
        session.seconds_per_token = self.token_seconds(self.client_region[client], route)
        session.segment_started = self.now + penalty
        finish = session.segment_started + session.tokens_left * session.seconds_per_token
        self.push(finish, "session_end", client, session.epoch)

    def cache_need(self, session: Session, blocks: int) -> float:
        return session.tokens * 2.0 * blocks

    def route_for(self, client: int, session: Session) -> list[tuple[int, int, int]] | None:
        """Route with the policy; a dead server chosen costs a failover and a ban, then route again."""
        for _ in range(10):
            began, began_cpu = time.perf_counter(), time.thread_time()
            slots, candidates = self.candidates(client, session)
            try:
                chosen = self.routing.route(candidates, 0, self.scenario.blocks, self.policy_rng)
            except ValueError:
                return None
            finally:
                if self.now >= self.warmup:
                    self.metrics.routing_seconds.append(time.perf_counter() - began)
                    self.metrics.routing_cpu_seconds.append(time.thread_time() - began_cpu)
            route = [(int(slots[index]), start, end) for index, start, end in chosen]
            dead = [slot for slot, _, _ in route if not self.alive[slot]]
            if not dead:
                return route
            self.bans[client][dead[0]] = self.now + self.scenario.ban_seconds
            session.started -= self.scenario.failover_seconds  # the time lost counts in its latency
            self.metrics.failovers += self.now >= self.warmup
        return None

    def candidates(self, client: int, session: Session) -> tuple[np.ndarray, RouteCandidates]:
        usable = self.state[: self.count] == ONLINE
        usable &= (
            self.cache_left[: self.count] >= session.tokens * 2.0 * (self.ends - self.starts)[: self.count]
        )
        bans = self.bans[client]
        for slot, until in list(bans.items()):
            if until <= self.now:
                del bans[slot]
            else:
                usable[slot] = False
        slots = np.flatnonzero(usable)
        return slots, self.route_candidates(slots, self.client_region[client])

    def route_candidates(self, slots: np.ndarray, client_region: int) -> RouteCandidates:
        regions = self.region[slots]
        return RouteCandidates(
            starts=self.starts[slots],
            ends=self.ends[slots],
            step_seconds=1.0 / self.inference_rps[self.gpu[slots]],
            client_rtt=self.rtt[client_region, regions] + self.jitter[slots],
            sites=regions,
            hop_seconds=self.rtt / 2,
        )

    def route_from(
        self, client_region: int, rng: np.random.Generator
    ) -> tuple[list[tuple[int, int, int]], float]:
        """A new session's route from ``client_region`` over the ONLINE servers now, and what one token
        takes on it (the session counted among its servers' sessions)."""
        slots = np.flatnonzero(self.alive[: self.count] & (self.state[: self.count] == ONLINE))
        chosen = self.routing.route(self.route_candidates(slots, client_region), 0, self.scenario.blocks, rng)
        route = [(int(slots[index]), start, end) for index, start, end in chosen]
        used = [slot for slot, _, _ in route]
        self.sessions[used] += 1
        seconds = self.token_seconds(client_region, route)
        self.sessions[used] -= 1
        return route, seconds

    def token_seconds(self, region: int, route: list[tuple[int, int, int]]) -> float:
        """What one token really takes on ``route`` from a client in ``region`` now: network, compute,
        the server's load, and each server's overhead."""
        penalty = self.scenario.batch_penalty
        slots = [slot for slot, _, _ in route]
        first, last = slots[0], slots[-1]
        seconds = (self.rtt[region, self.region[first]] + self.jitter[first]) / 2
        seconds += (self.rtt[region, self.region[last]] + self.jitter[last]) / 2
        for slot, start, end in route:
            step = (end - start) / self.inference_rps[self.gpu[slot]]
            seconds += step * (1 + penalty * (self.sessions[slot] - 1)) + self.hop_overhead
        for a, b in itertools.pairwise(slots):
            seconds += (self.rtt[self.region[a], self.region[b]] + self.jitter[a] + self.jitter[b]) / 2
        return float(seconds)

    def release(self, client: int, session: Session) -> None:
        for slot, start, end in session.route:
            self.sessions[slot] -= 1
            self.cache_left[slot] += self.cache_need(session, end - start)
            self.users.get(slot, set()).discard(client)
        session.route = []

    def on_session_end(self, client: int, epoch: int) -> None:
        session = self.active.get(client)
        if session is None or session.epoch != epoch:
            return
        self.release(client, session)
        del self.active[client]
        if session.started >= self.warmup:
            self.metrics.latencies.append((self.now - session.started) / session.tokens)
        think = float(self.client_rngs[client].exponential(self.scenario.think_seconds))
        self.push(self.now + think, "session", client)

    def evict(self, slot: int, failover: bool) -> None:
        """Sessions crossing ``slot`` route their remaining tokens again."""
        for client in list(self.users.pop(slot, ())):
            session = self.active[client]
            done = max(0.0, self.now - session.segment_started) / session.seconds_per_token
            session.tokens_left = max(1.0, session.tokens_left - done)
            self.release(client, session)
            self.metrics.failovers += failover and self.now >= self.warmup
            self.start_segment(client, session, self.scenario.failover_seconds if failover else 0.0)

    # ---- metrics -------------------------------------------------------------------------------

    def change(self) -> None:
        """The records or the serving servers change now: account for the time since the last change."""
        self.account(self.now)
        self.version += 1

    def account(self, until: float) -> None:
        since = max(self.last_change, self.warmup)
        if until > since:
            coverage, throughput, bound, servers = self.swarm_now()
            seconds = until - since
            m = self.metrics
            m.seconds += seconds
            m.covered_seconds += seconds * coverage
            m.throughput_integral += seconds * throughput
            m.bound_integral += seconds * bound
            m.server_seconds += seconds * servers
        self.last_change = max(self.last_change, until)

    def swarm_now(self) -> tuple[bool, float, float, int]:
        """(every block served?, bottleneck throughput, its upper bound, servers alive) right now."""
        slots = np.flatnonzero(self.alive[: self.count] & (self.state[: self.count] == ONLINE))
        forward = self.forward_rps[self.gpu[slots]]
        levels = block_sums(
            self.starts[slots],
            self.ends[slots],
            forward / (self.ends[slots] - self.starts[slots]),
            self.scenario.blocks,
        )
        alive = np.flatnonzero(self.alive[: self.count])
        bound = throughput_bound(self.forward_rps[self.gpu[alive]], self.scenario.blocks)
        return bool(levels.min() > 0), float(levels.min()), bound, len(alive)

    def on_sample(self) -> None:
        coverage, throughput, bound, _ = self.swarm_now()
        series = self.metrics.series
        series["hours"].append(self.now / 3600)
        series["coverage"].append(float(coverage))
        series["throughput"].append(throughput)
        series["bound"].append(bound)
        recent = self.metrics.latencies[-50:]
        series["latency_p50"].append(float(np.median(recent)) if recent else None)
        self.push(self.now + self.scenario.sample_seconds, "sample")


def throughput_bound(forward_rps: np.ndarray, blocks: int) -> float:
    """The highest bottleneck throughput any placement of these servers reaches: the optimum of the LP
    ``max F  s.t.  sum_s x[s,b] >= F for every block b,  sum_b x[s,b] <= forward_rps[s],  x >= 0``
    (a server may spend its compute on any blocks its memory holds, at least one), which is
    ``sum(forward_rps) / blocks``: the dual's weights are uniform over blocks."""
    return float(np.sum(forward_rps) / blocks)
