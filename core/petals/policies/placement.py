"""Placement: the blocks a ``--num_blocks`` server hosts, and when it moves to others.

A ``SwarmView`` holds the spans of the JOINING and ONLINE servers as arrays. Both policies fill the
weakest-covered region first: among all windows of the server's length, the one whose sorted per-block
levels are lexicographically smallest (ties: the lowest index). They differ in what a level is and in
when a server moves:

* ``petals22``: a block's level is the sum of the announced ``throughput`` of its servers. Petals
  announces ``forward_rps / ((length + 1) / 2)``, which overrates long spans by up to 2x over what they
  give each block (``forward_rps / length``). A server moves when, after it and then every other server
  moved to its best window, the bottleneck would be 1/``balance_quality`` times higher.
* ``ours``: a block's level is what its servers give it, ``forward_rps / length`` (the announced
  ``throughput`` where ``forward_rps`` is unknown). A server moves when the weakest block of its own
  window, without it, stays ``margin`` above the weakest block of the best window: then moving helps
  and moving back cannot (hysteresis), and a server never returns to a range it left within one mean
  check period.

Where later layers reuse the keys and values an earlier layer computed in the same pass, no span may
begin or end between them (``closed``, from ``petals.block.closed_boundaries``): both policies choose
only among the windows that hold such a group whole or leave it out.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EPS = 1e-3
EXACT_SETTLE_LIMIT = 32  # servers; above it petals22's settled swarm is taken at its balanced level


@dataclass(frozen=True)
class SwarmView:
    """The spans servers announce (JOINING or ONLINE), one entry per server."""

    total_blocks: int
    starts: np.ndarray
    ends: np.ndarray
    throughputs: np.ndarray  # announced ``throughput``
    forward_rps: np.ndarray  # announced ``forward_rps``, NaN where unknown
    closed: frozenset[int] = frozenset()  # boundaries where no span may begin or end

    @classmethod
    def from_spans(
        cls,
        total_blocks: int,
        spans: Sequence[tuple[int, int, float, float | None]],
        closed: frozenset[int] = frozenset(),
    ) -> SwarmView:
        """From ``(start, end, throughput, forward_rps or None)`` per server."""
        rows = np.array([(s, e, t, np.nan if f is None else f) for s, e, t, f in spans], dtype=float).reshape(
            -1, 4
        )
        starts, ends = rows[:, 0].astype(int), rows[:, 1].astype(int)
        return cls(total_blocks, starts, ends, rows[:, 2], rows[:, 3], closed)

    def __len__(self) -> int:
        return len(self.starts)


@dataclass(frozen=True)
class MoveDecision:
    """``blocks`` to move to, or None to stay; ``reason`` says why, for the server's log."""

    blocks: range | None
    reason: str


@dataclass(frozen=True)
class MoveHistory:
    """The range a server left last, and when (its clock)."""

    left: range | None = None
    left_at: float = -np.inf


def block_sums(starts: np.ndarray, ends: np.ndarray, values: np.ndarray, total_blocks: int) -> np.ndarray:
    """Per block, the sum of ``values`` of the spans covering it."""
    length = total_blocks + 1
    diff = np.bincount(starts, values, length) - np.bincount(ends, values, length)
    return np.cumsum(diff)[:-1]


def shared_groups(closed: frozenset[int]) -> list[range]:
    """The runs of blocks that one server must hold whole, given the ``closed`` boundaries: boundaries
    3, 4 and 5 (layers 4 and 5 reuse the keys and values of layers 2 and 3) make blocks 2:6 one group."""
    groups: list[range] = []
    for boundary in sorted(closed):
        if groups and groups[-1].stop == boundary:
            groups[-1] = range(groups[-1].start, boundary + 1)
        else:
            groups.append(range(boundary - 1, boundary + 1))
    return groups


def span_lengths(total_blocks: int, closed: frozenset[int]) -> list[int]:
    """Every length a span of the model's blocks can have without beginning or ending at a closed boundary."""
    edges = [edge for edge in range(total_blocks + 1) if edge not in closed]
    return sorted({stop - start for start, stop in itertools.combinations(edges, 2)})


def no_span_fits(total_blocks: int, length: int, closed: frozenset[int]) -> str:
    """Why no span of ``length`` blocks can be placed, in one line, with the nearest lengths that fit."""
    groups = ", ".join(f"{group.start}:{group.stop}" for group in shared_groups(closed))
    lengths = span_lengths(total_blocks, closed)
    shorter = [fits for fits in lengths if fits < length][-1:]
    longer = [fits for fits in lengths if fits > length][:1]
    return (
        f"no span of {length} blocks fits without splitting blocks {groups}, which share keys and values "
        f"and must be served by one server; the nearest spans that fit hold "
        f"{' or '.join(map(str, shorter + longer))} blocks"
    )


@functools.cache
def _window_indices(total: int, length: int, closed: frozenset[int]) -> np.ndarray:
    """``[window, block]``: each window of ``length`` blocks that begins and ends at an open boundary."""
    starts = [start for start in range(total - length + 1) if not {start, start + length} & closed]
    return np.array(starts, dtype=int)[:, None] + np.arange(length)


def weakest_window(levels: np.ndarray, length: int, closed: frozenset[int] = frozenset()) -> int:
    """The start of the window whose sorted levels are lexicographically smallest (ties: lowest), among
    those that neither begin nor end at a ``closed`` boundary; ValueError if there are none."""
    indices = _window_indices(len(levels), length, closed)
    if not len(indices):
        raise ValueError(no_span_fits(len(levels), length, closed))
    windows = levels[indices]
    minima = windows.min(axis=1)
    candidates = np.flatnonzero(minima == minima.min())
    if len(candidates) == 1:
        return int(indices[candidates[0], 0])
    ordered = np.sort(windows[candidates], axis=1)
    return int(indices[candidates[np.lexsort(ordered.T[::-1])[0]], 0])


class Placement:
    """The interface the server and the simulator call."""

    name = "placement"
    mean_check_period: float = 60.0

    def capacities(self, view: SwarmView) -> np.ndarray:
        """What each server adds to the level of each block it hosts."""
        raise NotImplementedError

    def levels(self, view: SwarmView) -> np.ndarray:
        return block_sums(view.starts, view.ends, self.capacities(view), view.total_blocks)

    def choose_blocks(self, view: SwarmView, num_blocks: int) -> range:
        """The blocks a new server with ``num_blocks`` blocks should host (``view`` lacks it)."""
        num_blocks = min(num_blocks, view.total_blocks)
        start = weakest_window(self.levels(view), num_blocks, view.closed)
        return range(start, start + num_blocks)

    def check_delay(self, rng: np.random.Generator) -> float:
        """Seconds until the next balance check: uniform, with mean ``mean_check_period``."""
        return float(rng.uniform(0, 2 * self.mean_check_period))

    def choose_new_blocks(
        self,
        view: SwarmView,
        index: int,
        *,
        now: float,
        rng: np.random.Generator,
        history: MoveHistory,
        levels: np.ndarray | None = None,
    ) -> MoveDecision:
        """Whether server ``index`` of ``view`` should move; ``levels``: ``self.levels(view)`` if known."""
        raise NotImplementedError


def _staying(current: range, why: str) -> MoveDecision:
    return MoveDecision(None, f"staying on blocks {current.start}:{current.stop}, {why}")


class Petals22Placement(Placement):
    """Petals 2.2's rules (``choose_best_blocks``, ``should_choose_other_blocks``)."""

    name = "petals22"

    def __init__(self, balance_quality: float = 0.75, mean_check_period: float = 60.0) -> None:
        self.balance_quality, self.mean_check_period = balance_quality, mean_check_period

    def capacities(self, view: SwarmView) -> np.ndarray:
        return view.throughputs

    def choose_new_blocks(
        self,
        view: SwarmView,
        index: int,
        *,
        now: float,
        rng: np.random.Generator,
        history: MoveHistory,
        levels: np.ndarray | None = None,
    ) -> MoveDecision:
        current = range(int(view.starts[index]), int(view.ends[index]))
        if self.balance_quality <= 0:
            return _staying(current, "balancing is off")
        levels = self.levels(view) if levels is None else levels.copy()
        own = view.throughputs[index]
        initial = levels.min()
        levels[current.start : current.stop] -= own * (1 + EPS)  # the EPS biases towards staying
        if initial > EPS and levels.min() <= 0:
            return _staying(current, "the only server for some of them")
        new_start = weakest_window(levels, len(current), view.closed)
        if new_start == current.start:
            return _staying(current, "still the best range for this server")
        new_blocks = range(new_start, new_start + len(current))
        if self.balance_quality > 1.0:
            return MoveDecision(new_blocks, "moving is forced (balance_quality > 1)")
        levels[current.start : current.stop] += own * EPS
        starts = view.starts.copy()
        starts[index] = new_start
        levels[new_blocks.start : new_blocks.stop] += own
        new = self._settled_bottleneck(view, starts, levels, rng)
        if new < initial or new < EPS:
            return _staying(current, "moving would not raise the swarm's throughput")
        quality = initial / new
        if quality < self.balance_quality - EPS:
            return MoveDecision(new_blocks, f"swarm balance quality {quality:.1%}, moving would help")
        return _staying(current, f"swarm balance quality {quality:.1%}")

    def _settled_bottleneck(
        self, view: SwarmView, starts: np.ndarray, levels: np.ndarray, rng: np.random.Generator
    ) -> float:
        """The bottleneck once every server moved to its own best window until none moves.

        Petals simulates this server by server; above ``EXACT_SETTLE_LIMIT`` servers (the simulator's
        swarms) the settled swarm is taken at its balanced level, the mean level, which such a swarm
        reaches within a fraction of one server's throughput.
        """
        if len(view) > EXACT_SETTLE_LIMIT:
            return float(levels.sum() / view.total_blocks)
        lengths = view.ends - view.starts
        moved = True
        while moved:
            moved = False
            for peer in rng.permutation(len(view)):
                start, length, own = starts[peer], lengths[peer], view.throughputs[peer]
                levels[start : start + length] -= own * (1 + EPS)
                best = weakest_window(levels, length, view.closed)
                levels[start : start + length] += own * EPS
                if best != start:
                    starts[peer], start, moved = best, best, True
                levels[start : start + length] += own
        return float(levels.min())


class OursPlacement(Placement):
    """Levels from what servers give each block, and moves with hysteresis (see the module docstring)."""

    name = "ours"

    def __init__(self, margin: float = 0.15, mean_check_period: float = 60.0) -> None:
        self.margin, self.mean_check_period = margin, mean_check_period

    def capacities(self, view: SwarmView) -> np.ndarray:
        per_block = view.forward_rps / np.maximum(view.ends - view.starts, 1)
        return np.where(np.isfinite(per_block) & (per_block > 0), per_block, view.throughputs)

    def capacity(self, view: SwarmView, index: int) -> float:
        per_block = view.forward_rps[index] / max(view.ends[index] - view.starts[index], 1)
        return (
            float(per_block) if np.isfinite(per_block) and per_block > 0 else float(view.throughputs[index])
        )

    def choose_new_blocks(
        self,
        view: SwarmView,
        index: int,
        *,
        now: float,
        rng: np.random.Generator,
        history: MoveHistory,
        levels: np.ndarray | None = None,
    ) -> MoveDecision:
        current = range(int(view.starts[index]), int(view.ends[index]))
        levels = self.levels(view) if levels is None else levels.copy()
        initial = levels.min()
        levels[current.start : current.stop] -= self.capacity(view, index)
        here = levels[current.start : current.stop].min()
        if initial > EPS and here <= EPS:
            return _staying(current, "the only server for some of them")
        new_start = weakest_window(levels, len(current), view.closed)
        if new_start == current.start:
            return _staying(current, "still the best range for this server")
        new_blocks = range(new_start, new_start + len(current))
        there = levels[new_blocks.start : new_blocks.stop].min()
        if here <= there * (1 + self.margin):
            return _staying(
                current, f"its weakest block would be {here / max(there, EPS):.2f}x the best range's"
            )
        if new_blocks == history.left and now - history.left_at < self.mean_check_period:
            return _staying(
                current, f"it left blocks {new_start}:{new_blocks.stop} {now - history.left_at:.0f} s ago"
            )
        return MoveDecision(
            new_blocks, f"weakest block {there:.1f} there against {here:.1f} here, moving would help"
        )


PLACEMENTS: dict[str, type[Placement]] = {"ours": OursPlacement, "petals22": Petals22Placement}
