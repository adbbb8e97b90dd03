"""Which blocks a ``--num_blocks`` server hosts, and when it should move (Petals' balancing rules).

Throughput per block = the sum of announced throughputs of JOINING and ONLINE servers covering it.
A server takes the window of consecutive blocks whose sorted throughputs are lexicographically
smallest (the weakest-covered region; ties → lowest index). While serving, it moves only if the
swarm's bottleneck throughput would improve by more than ``balance_quality`` and its best window
differs from the one it serves (Petals bug #389: reloading the same blocks).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

from hivemind.p2p import PeerID

from petals.data_structures import RemoteModuleInfo, RemoteSpanInfo, ServerState
from petals.dht import compute_spans

logger = logging.getLogger(__name__)

EPS = 1e-3


def compute_throughputs(spans: dict[PeerID, RemoteSpanInfo], total_blocks: int) -> list[float]:
    throughputs = [0.0] * total_blocks
    for peer_id in sorted(spans, key=str):  # a fixed order keeps float sums deterministic
        span = spans[peer_id]
        for index in range(span.start, span.end):
            throughputs[index] += span.throughput
    return throughputs


def choose_best_start(throughputs: Sequence[float], num_blocks: int) -> int:
    starts = range(len(throughputs) - num_blocks + 1)
    return min(starts, key=lambda start: (sorted(throughputs[start : start + num_blocks]), start))


def choose_best_blocks(num_blocks: int, module_infos: Sequence[RemoteModuleInfo]) -> range:
    """The blocks a new server with ``num_blocks`` blocks should host."""
    num_blocks = min(num_blocks, len(module_infos))
    spans = compute_spans(module_infos, min_state=ServerState.JOINING)
    start = choose_best_start(compute_throughputs(spans, len(module_infos)), num_blocks)
    return range(start, start + num_blocks)


def choose_new_blocks(
    local_peer_id: PeerID, module_infos: Sequence[RemoteModuleInfo], balance_quality: float
) -> range | None:
    """The blocks this server should move to, or None to stay where it is.

    ``balance_quality`` > 1 forces a move to the best window (a debugging aid) and 0 disables
    moving; None is returned whenever the best window is the current one.
    """
    spans = compute_spans(module_infos, min_state=ServerState.JOINING)
    if local_peer_id not in spans or balance_quality <= 0:
        return None
    throughputs = compute_throughputs(spans, len(module_infos))
    local = spans[local_peer_id]
    current = f"blocks {local.start}:{local.end}"
    initial_bottleneck = min(throughputs)
    _shift(throughputs, local, -local.throughput * (1 + EPS))  # the EPS biases towards staying
    if initial_bottleneck > EPS and min(throughputs) <= 0:
        logger.info("Balance check: staying on %s, the only server for some of them", current)
        return None
    new_start = choose_best_start(throughputs, local.length)
    if new_start == local.start:
        logger.info("Balance check: staying on %s, still the best range for this server", current)
        return None
    new_blocks = range(new_start, new_start + local.length)
    if balance_quality > 1.0:
        return new_blocks
    _shift(throughputs, local, local.throughput * EPS)
    _move(throughputs, local, new_start)
    _settle_swarm(throughputs, spans)
    new_bottleneck = min(throughputs)
    if new_bottleneck < initial_bottleneck or new_bottleneck < EPS:
        logger.info("Balance check: staying on %s, moving would not raise the swarm's throughput", current)
        return None
    quality = initial_bottleneck / new_bottleneck
    if quality < balance_quality - EPS:
        logger.info("Balance check: swarm balance quality %.1f%%, moving would help", quality * 100)
        return new_blocks
    logger.info("Balance check: staying on %s, swarm balance quality %.1f%%", current, quality * 100)
    return None


def _settle_swarm(throughputs: list[float], spans: dict[PeerID, RemoteSpanInfo]) -> None:
    """Simulate every server moving to its own best window until nobody moves."""
    moved = True
    while moved:
        moved = False
        peers = list(spans)
        random.shuffle(peers)
        for peer_id in peers:
            span = spans[peer_id]
            _shift(throughputs, span, -span.throughput * (1 + EPS))
            best = choose_best_start(throughputs, span.length)
            _shift(throughputs, span, span.throughput * EPS)
            if best != span.start:
                _move(throughputs, span, best)
                moved = True
            else:
                _shift(throughputs, span, span.throughput)


def _move(throughputs: list[float], span: RemoteSpanInfo, new_start: int) -> None:
    length = span.length
    span.start, span.end = new_start, new_start + length
    _shift(throughputs, span, span.throughput)


def _shift(throughputs: list[float], span: RemoteSpanInfo, delta: float) -> None:
    for index in range(span.start, span.end):
        throughputs[index] += delta
