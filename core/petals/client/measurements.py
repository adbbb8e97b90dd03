"""What the client measured of each server, and what routing and step deadlines take from it.

Servers announce their speed (``throughput``, ``inference_rps``) and nothing makes them tell the
truth. The client times every request it sends (inference steps and forwards) and keeps, per server,
smoothed step times and rates:

* routing (``measured_spans``): once a server has ``trusted_after`` samples, its spans carry
  ``min(announced, measured)`` throughput and ``inference_rps``, so a server that overstates its
  speed gets at most the share of routes its measured speed earns;
* deadlines (``deadline``): a timed server waits ``factor`` times its usual step (scaled up for
  steps with more tokens than usual); a server never timed waits ``factor`` times what its
  announced throughput says the step needs, bounded by what the slowest timed server of the same
  blocks took, and the full ``ceiling`` (``request_timeout``) only when neither is known. The only
  server of its blocks always waits the ``ceiling``, timed or not: there is nowhere else to go, so giving
  up on it sooner only turns its stall into a failure. A hung replacement is thus left in seconds.
  Every deadline lies in ``[floor, ceiling]``.

Measured rates use the announced units: ``throughput`` is tokens per second of a request crossing
half the server's blocks (``server.throughput``), ``inference_rps`` single-token steps per second
through one block. A measured rate includes the network, as the client lives it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.p2p import PeerID

from petals.data_structures import RemoteSpanInfo


@dataclass
class _Timing:
    start: int  # the blocks of the last timed request
    end: int
    samples: int = 0
    throughput: float = 0.0
    # inference steps only
    steps: int = 0
    seconds: float = 0.0
    tokens: float = 0.0
    inference_rps: float = 0.0

    def expected(self, tokens: int) -> float:
        """Seconds a step of ``tokens`` should take on this server, from its usual steps."""
        return self.seconds * max(1.0, tokens / self.tokens)


class ServerMeasurements:
    """Per-server timings of this client's requests; see the module docstring."""

    def __init__(
        self,
        floor: float,
        ceiling: float,
        factor: float = 10.0,
        smoothing: float = 0.5,
        trusted_after: int = 3,
    ) -> None:
        self.floor, self.ceiling, self.factor = floor, ceiling, factor
        self.smoothing, self.trusted_after = smoothing, trusted_after
        self._timings: dict[PeerID, _Timing] = {}

    def observe(self, span: RemoteSpanInfo, tokens: int, seconds: float, *, inference: bool = True) -> None:
        """``span``'s server answered a request of ``tokens`` tokens (batch x length) in ``seconds``."""
        seconds = max(seconds, 1e-6)
        timing = self._timings.setdefault(span.peer_id, _Timing(span.start, span.end))
        timing.start, timing.end = span.start, span.end
        throughput = tokens / seconds * span.length / _half_blocks(span)
        timing.throughput = self._smooth(timing.throughput, throughput, timing.samples)
        timing.samples += 1
        if inference:
            rps = span.length / seconds
            timing.seconds = self._smooth(timing.seconds, seconds, timing.steps)
            timing.tokens = self._smooth(timing.tokens, float(max(tokens, 1)), timing.steps)
            timing.inference_rps = self._smooth(timing.inference_rps, rps, timing.steps)
            timing.steps += 1

    def _smooth(self, old: float, new: float, samples: int) -> float:
        return new if samples == 0 else (1 - self.smoothing) * old + self.smoothing * new

    def samples(self, peer: PeerID) -> int:
        timing = self._timings.get(peer)
        return timing.samples if timing is not None else 0

    def measured_throughput(self, peer: PeerID) -> float | None:
        timing = self._timings.get(peer)
        return timing.throughput if timing is not None and timing.samples else None

    def deadline(self, span: RemoteSpanInfo, tokens: int, replaceable: bool = True) -> float:
        """How long to wait for ``span``'s server to answer an inference step of ``tokens`` tokens.

        The only server of its blocks (``replaceable`` False) waits the ``ceiling``, timed or not: giving
        up on it sooner could only turn a slow step or a short stall into a failure.
        """
        if not replaceable:
            return self.ceiling
        timing = self._timings.get(span.peer_id)
        if timing is not None and timing.steps:
            return self._clamp(self.factor * timing.expected(tokens))
        estimates = []
        announced = span.server_info.throughput
        if announced and announced > 0:
            estimates.append(tokens * span.length / (announced * _half_blocks(span)))
        others = [
            other.expected(tokens) * span.length / (other.end - other.start)
            for peer, other in self._timings.items()
            if peer != span.peer_id and other.steps and other.start < span.end and span.start < other.end
        ]
        if others:
            estimates.append(max(others))
        if not estimates:
            return self.ceiling
        return self._clamp(self.factor * min(estimates))

    def _clamp(self, seconds: float) -> float:
        return min(max(seconds, self.floor), self.ceiling)

    def measured_spans(self, spans: Sequence[RemoteSpanInfo]) -> list[RemoteSpanInfo]:
        """``spans`` with each trusted-measured server's speed lowered to what this client measured."""
        return [self._measured(span) for span in spans]

    def throughput_share(self, spans: Sequence[RemoteSpanInfo], peer: PeerID) -> float:
        """``peer``'s share of ``spans``' total throughput as routing sees it now (measured where trusted)."""
        measured = self.measured_spans(spans)
        total = sum(span.throughput for span in measured)
        return sum(span.throughput for span in measured if span.peer_id == peer) / total if total else 0.0

    def _measured(self, span: RemoteSpanInfo) -> RemoteSpanInfo:
        timing = self._timings.get(span.peer_id)
        if timing is None or timing.samples < self.trusted_after:
            return span
        info = span.server_info
        changes: dict[str, float] = {}
        if timing.throughput < info.throughput:
            changes["throughput"] = timing.throughput
        if timing.steps >= self.trusted_after and (
            info.inference_rps is None or timing.inference_rps < info.inference_rps
        ):
            changes["inference_rps"] = timing.inference_rps
        if not changes:
            return span
        return dataclasses.replace(span, server_info=dataclasses.replace(info, **changes))


def _half_blocks(span: RemoteSpanInfo) -> float:
    """``(num_blocks + 1) / 2`` of the server's announced span (``server.throughput``'s divisor)."""
    info = span.server_info
    if info.start_block is not None and info.end_block is not None and info.end_block > info.start_block:
        blocks = info.end_block - info.start_block
    else:
        blocks = span.length
    return (blocks + 1) / 2
