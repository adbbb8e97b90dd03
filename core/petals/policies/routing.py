"""Routing: the chain of servers an inference session crosses, chosen for the lowest per-token latency.

Both policies take Petals' graph (nodes: a server at a block boundary) and its edge costs: entering the
first server costs half the client's ping to it plus a per-hop overhead, each block costs the server's
seconds per block (``1 / inference_rps``), switching from server ``p`` to ``q`` at a boundary (only after
using ``p``) costs the one-way delay between them plus the overhead, and leaving costs half a ping.
The graph is a DAG over boundaries, so a dynamic program over boundaries finds what Dijkstra finds, one
vectorized step per block. Where later layers reuse the keys and values an earlier layer computed in
the same pass (``closed``, from ``petals.block.closed_boundaries``), a chain crosses the boundaries
between them on one server: no switch is allowed there.

* ``petals22``: Petals 2.2's costs as they are.
* ``ours``: each server's seconds per block are scaled by its load (sessions it serves, where known)
  and by a random factor in ``[1, 1 + spread]`` drawn per request, so that clients do not all pile onto
  the same fastest chain: near-equal routes share the load.

One-way delays between servers come as a matrix between *sites*: the simulator's regions, or, for the
live client, one site per server with the pings servers announce (``next_pings``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOP_OVERHEAD = 0.018  # seconds of (de)serialization and scheduling per server visited


@dataclass(frozen=True)
class RouteCandidates:
    """The spans a client may use (already filtered: online, not banned, with cache for the session)."""

    starts: np.ndarray
    ends: np.ndarray
    step_seconds: np.ndarray  # per block, 1 / inference_rps
    client_rtt: np.ndarray  # the client's round trip to each server
    sites: np.ndarray  # each server's site: an index into ``hop_seconds``
    hop_seconds: np.ndarray  # [site, site]: one-way delay from a server at one site to one at another
    load: np.ndarray | None = None  # sessions each server serves, where known
    closed: frozenset[int] = frozenset()  # boundaries where a chain may not switch servers

    def __len__(self) -> int:
        return len(self.starts)


Route = list[tuple[int, int, int]]  # (candidate index, start block, end block)


class Routing:
    name = "routing"

    def step_costs(self, candidates: RouteCandidates, rng: np.random.Generator) -> np.ndarray:
        return candidates.step_seconds

    def route(self, candidates: RouteCandidates, start: int, end: int, rng: np.random.Generator) -> Route:
        """The lowest-cost chain over blocks ``[start, end)``; ValueError if some block has no server."""
        return min_latency_route(candidates, start, end, self.step_costs(candidates, rng))


class Petals22Routing(Routing):
    name = "petals22"


class OursRouting(Routing):
    name = "ours"

    def __init__(self, spread: float = 0.5, load_weight: float = 0.5) -> None:
        self.spread, self.load_weight = spread, load_weight

    def step_costs(self, candidates: RouteCandidates, rng: np.random.Generator) -> np.ndarray:
        steps = candidates.step_seconds * rng.uniform(1.0, 1.0 + self.spread, len(candidates))
        if candidates.load is not None:
            steps = steps * (1.0 + self.load_weight * candidates.load)
        return steps


ROUTINGS: dict[str, type[Routing]] = {"ours": OursRouting, "petals22": Petals22Routing}


def min_latency_route(candidates: RouteCandidates, start: int, end: int, steps: np.ndarray) -> Route:
    c = candidates
    if start in c.closed or end in c.closed:
        raise ValueError(
            f"blocks {start}:{end} begin or end between blocks that share keys and values, which one "
            "server serves together: route from and to a boundary outside them"
        )
    order = np.argsort(c.sites, kind="stable")  # servers grouped by site, for one reduceat per block
    site_ids, site_starts = np.unique(c.sites[order], return_index=True)
    hops = c.hop_seconds[np.ix_(site_ids, site_ids)] + HOP_OVERHEAD
    local_site = np.searchsorted(site_ids, c.sites[order])
    starts, ends = c.starts[order], c.ends[order]
    blocks = np.arange(start, end)[:, None]
    absent = np.where((starts <= blocks) & (blocks < ends), 0.0, np.inf)  # [block - start, server]
    compute = steps[order] + absent
    at = c.client_rtt[order] / 2 + HOP_OVERHEAD + absent[0]
    ats, useds = [at], []
    for offset in range(end - start):
        used = at + compute[offset]
        useds.append(used)
        if offset + 1 == end - start:
            break
        if start + offset + 1 in c.closed:
            at = used  # the blocks on both sides share keys and values: no switch here
        else:
            best_per_site = np.minimum.reduceat(used, site_starts)
            into_site = (best_per_site[:, None] + hops).min(axis=0)
            at = np.minimum(used, into_site[local_site])  # servers not covering the next block: inf there
        ats.append(at)
    total = useds[-1] + c.client_rtt[order] / 2
    last = int(np.argmin(total))
    if not np.isfinite(total[last]):
        raise ValueError(f"no chain of servers covers blocks {start}:{end}")
    route = _backtrack(start, ats, useds, last, hops, local_site)
    return [(int(order[peer]), first, stop) for peer, first, stop in route]


def _backtrack(
    start: int,
    ats: list[np.ndarray],
    useds: list[np.ndarray],
    last: int,
    hops: np.ndarray,
    local_site: np.ndarray,
) -> Route:
    route: Route = []
    peer, span_end = last, start + len(useds)
    for offset in range(len(useds) - 1, 0, -1):
        if ats[offset][peer] == useds[offset - 1][peer]:
            continue  # reached by computing the previous block on the same server (always, if closed)
        route.append((peer, start + offset, span_end))
        switch = useds[offset - 1] + hops[local_site, local_site[peer]]
        switch[peer] = np.inf
        peer, span_end = int(np.argmin(switch)), start + offset
    route.append((peer, start, span_end))
    return route[::-1]
