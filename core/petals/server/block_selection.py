"""Which blocks a ``--num_blocks`` server hosts, and when it should move: the DHT records turned into the
placement policy's input (``petals.policies.placement``), and the policy's answer.

``--placement ours`` (the default) or ``petals22`` chooses the policy; ``--balance_quality`` keeps
Petals' meaning for both: 0 never moves, above 1 always moves to the best range when it differs (a
debugging aid), and for ``petals22`` the value in between is its threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hivemind.p2p import PeerID

from petals.data_structures import RemoteModuleInfo, ServerState
from petals.dht import compute_spans
from petals.policies.placement import (
    PLACEMENTS,
    MoveDecision,
    MoveHistory,
    OursPlacement,
    Petals22Placement,
    Placement,
    SwarmView,
    weakest_window,
)

PLACEMENT_CHOICES = tuple(PLACEMENTS)


def make_placement(
    name: str = "ours", balance_quality: float = 0.75, mean_check_period: float = 60
) -> Placement:
    if name == "petals22":
        return Petals22Placement(balance_quality, mean_check_period)
    if name == "ours":
        forced = balance_quality > 1.0
        return OursPlacement(
            margin=-1.0 if forced else OursPlacement().margin, mean_check_period=mean_check_period
        )
    raise ValueError(f"unknown placement {name!r}; choose from {', '.join(PLACEMENT_CHOICES)}")


def swarm_view(
    module_infos: Sequence[RemoteModuleInfo], closed: frozenset[int] = frozenset()
) -> tuple[SwarmView, list[PeerID]]:
    """The JOINING and ONLINE servers' spans, in a fixed order (by peer id), and their peer ids;
    ``closed``: the model's ``petals.block.closed_boundaries``, where no span may begin or end."""
    spans = compute_spans(module_infos, min_state=ServerState.JOINING)
    peers = sorted(spans, key=str)
    rows = [
        (spans[peer].start, spans[peer].end, spans[peer].throughput, spans[peer].server_info.forward_rps)
        for peer in peers
    ]
    return SwarmView.from_spans(len(module_infos), rows, closed), peers


def choose_best_start(throughputs: Sequence[float], num_blocks: int) -> int:
    return weakest_window(np.asarray(throughputs, dtype=float), num_blocks)


def choose_best_blocks(
    num_blocks: int,
    module_infos: Sequence[RemoteModuleInfo],
    placement: Placement | None = None,
    closed: frozenset[int] = frozenset(),
) -> range:
    """The blocks a new server with ``num_blocks`` blocks should host."""
    view, _ = swarm_view(module_infos, closed)
    return (placement or make_placement()).choose_blocks(view, num_blocks)


def decide_move(
    local_peer_id: PeerID,
    module_infos: Sequence[RemoteModuleInfo],
    placement: Placement,
    *,
    balance_quality: float,
    now: float,
    rng: np.random.Generator,
    history: MoveHistory,
    closed: frozenset[int] = frozenset(),
) -> MoveDecision:
    view, peers = swarm_view(module_infos, closed)
    if local_peer_id not in peers:
        return MoveDecision(None, "staying: this server's records are not in the DHT yet")
    if balance_quality <= 0:
        return MoveDecision(None, "staying: balancing is off (balance_quality 0)")
    return placement.choose_new_blocks(view, peers.index(local_peer_id), now=now, rng=rng, history=history)


def choose_new_blocks(
    local_peer_id: PeerID,
    module_infos: Sequence[RemoteModuleInfo],
    balance_quality: float,
    placement: str = "ours",
    closed: frozenset[int] = frozenset(),
) -> range | None:
    """The blocks this server should move to, or None to stay where it is (never its current range)."""
    decision = decide_move(
        local_peer_id,
        module_infos,
        make_placement(placement, balance_quality),
        balance_quality=balance_quality,
        now=0.0,
        rng=np.random.default_rng(),
        history=MoveHistory(),
        closed=closed,
    )
    return decision.blocks
