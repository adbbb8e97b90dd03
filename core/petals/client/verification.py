"""Verified outputs: a client option (``verify``, the fraction of steps) that recomputes sampled
inference steps of each span on another server of the same blocks and bans servers that lie.

A sampled step's span is recomputed by a second server that serves those blocks: it is replayed the
session's whole history for the span (as failover replays it to a replacement) and its outputs for
the step's positions are compared with the first server's. They agree when, at every position, the
relative error ``|a - b| / |b|`` over the hidden dimension is within the tolerance of the coarsest
dtype involved (``TOLERANCES``, measured on honest servers: KV-cache steps against replays, merged
against solo batches, 1 against 2 threads). A mismatch asks a third server: the one of the two that
disagrees with it while the other agrees is a liar. A liar is banned for the client's lifetime
(``Suspects``), reported once as a WARNING naming its peer id, listed by the model's ``suspects()``
and counted by ``petals api``'s ``/metrics``. When the liar computed the step, its session is
replaced and the step recomputed, so no lie reaches the tokens.

What cannot be caught: a perturbation below the tolerance, a step that is not sampled, a span no
other server serves, and a majority of colluding servers (the third opinion sides with them).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import uuid
import weakref
from pathlib import Path

import torch
from hivemind.p2p import PeerID

from petals.block import shared_kv_kwargs
from petals.client.server_session import ServerSession
from petals.client.suspects import Suspects
from petals.data_structures import RemoteSpanInfo
from petals.loading import load_block
from petals.server.backend import add_prompt

logger = logging.getLogger(__name__)

# the largest relative error at any position that honest servers showed, times a safety margin
TOLERANCES = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
COARSEST = max(TOLERANCES.values())


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest ``|output - reference| / |reference|`` over positions (norms over the hidden dimension)."""
    output, reference = output.float(), reference.float()
    difference = (output - reference).norm(dim=-1)
    scale = reference.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return float((difference / scale).max()) if difference.numel() else 0.0


def tolerance(*dtypes: str | torch.dtype | None) -> float:
    """The tolerance of the coarsest of ``dtypes`` (an unknown or missing one counts as the coarsest)."""
    names = [str(dtype).removeprefix("torch.") if dtype is not None else None for dtype in dtypes]
    return max(TOLERANCES.get(name, COARSEST) if name is not None else COARSEST for name in names)


class Verifier:
    """Samples steps with probability ``fraction`` and judges a sampled step of a span; see the module."""

    def __init__(self, manager, fraction: float, rng: random.Random | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify must be a fraction of steps between 0 and 1, got {fraction}")
        self.manager, self.fraction = manager, fraction
        self.rng = rng or random.Random()

    def sample(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    async def judge(
        self, span: RemoteSpanInfo, inputs: torch.Tensor, prompts: torch.Tensor | None, output: torch.Tensor
    ) -> PeerID | None:
        """The liar among ``span``'s server and the servers asked to recompute its step, if one is found.

        ``inputs`` is the span's whole history including the step, ``output`` the step's outputs;
        ``prompts`` the span's deep prompts of position 0. No second server: nothing is judged.
        """
        suspects: Suspects = self.manager.suspects
        asked = {span.peer_id}
        second = await self._recompute(span, inputs, prompts, output.shape[1], asked)
        if second is None:
            return await self._judge_locally(span, inputs, prompts, output)
        second_peer, second_output, second_dtype = second
        limit = tolerance(span.server_info.torch_dtype, second_dtype, output.dtype)
        error = relative_error(output, second_output)
        suspects.count(error, limit)
        if error <= limit:
            return None
        third = await self._recompute(span, inputs, prompts, output.shape[1], asked)
        third = third or await self._recompute_locally(span, inputs, prompts, output.shape[1])
        if third is None:
            logger.warning(
                "Servers %s and %s disagree on blocks %d:%d (relative error %.1e, tolerance %.0e) and no "
                "third server is there to decide",
                span.peer_id,
                second_peer,
                span.start,
                span.end,
                error,
                limit,
            )
            return None
        position = inputs.shape[1] - output.shape[1]
        return self._majority(
            span, (span.peer_id, output), (second_peer, second_output), third, limit, position
        )

    def _majority(
        self,
        span: RemoteSpanInfo,
        first: tuple[PeerID, torch.Tensor],
        second: tuple[PeerID, torch.Tensor],
        third: tuple[PeerID | None, torch.Tensor, str | None],
        limit: float,
        position: int,
    ) -> PeerID | None:
        """Of two disagreeing answers, the one the third opinion disagrees with is a liar's (accused)."""
        third_peer, third_output, third_dtype = third
        limit = max(limit, tolerance(third_dtype))
        first_error, second_error = (relative_error(answer, third_output) for _, answer in (first, second))
        if first_error > limit >= second_error:
            liar, wrong = first[0], first_error
        elif second_error > limit >= first_error:
            liar, wrong = second[0], second_error
        else:
            logger.warning(
                "Three answers disagree on blocks %d:%d (%s, %s, %s); nobody is banned",
                span.start,
                span.end,
                first[0],
                second[0],
                _name(third_peer),
            )
            return None
        honest = [_name(peer) for peer in (first[0], second[0], third_peer) if peer != liar]
        self.manager.suspects.accuse(
            liar,
            span,
            f"relative error {wrong:.1e} against {honest[0]} and {honest[1]}, which agree "
            f"(tolerance {limit:.0e}) at position {position}",
        )
        return liar

    async def _judge_locally(
        self, span: RemoteSpanInfo, inputs: torch.Tensor, prompts: torch.Tensor | None, output: torch.Tensor
    ) -> PeerID | None:
        """No second server: the client's own copy of the blocks (if it has their weights) decides alone."""
        local = await self._recompute_locally(span, inputs, prompts, output.shape[1])
        if local is None:
            return None
        _, local_output, local_dtype = local
        limit = tolerance(span.server_info.torch_dtype, local_dtype, output.dtype)
        error = relative_error(output, local_output)
        self.manager.suspects.count(error, limit)
        if error <= limit:
            return None
        self.manager.suspects.accuse(
            span.peer_id,
            span,
            f"relative error {error:.1e} against this client's own computation (tolerance {limit:.0e}) "
            f"at position {inputs.shape[1] - output.shape[1]}",
        )
        return span.peer_id

    async def _recompute_locally(
        self, span: RemoteSpanInfo, inputs: torch.Tensor, prompts: torch.Tensor | None, length: int
    ) -> tuple[PeerID | None, torch.Tensor, str] | None:
        """The last ``length`` outputs of this client's own copy of ``span``'s blocks, if it has their weights."""
        blocks = _local_blocks(self.manager)
        if not blocks.available:
            return None
        try:
            output = await asyncio.to_thread(blocks.run, span.start, span.end, inputs, prompts)
        except Exception as error:  # the client's own failure is not evidence against anyone
            logger.warning(
                "Cannot recompute blocks %d:%d locally to verify them: %s", span.start, span.end, error
            )
            blocks.available = False
            return None
        return None, output[:, -length:], "float32"

    async def _recompute(
        self,
        span: RemoteSpanInfo,
        inputs: torch.Tensor,
        prompts: torch.Tensor | None,
        length: int,
        asked: set[PeerID],
    ) -> tuple[PeerID, torch.Tensor, str | None] | None:
        """The last ``length`` outputs of another server of ``span``'s blocks, replayed ``inputs``."""
        candidates = [
            other
            for other in self.manager.usable_spans()
            if other.start <= span.start and span.end <= other.end and other.peer_id not in asked
        ]
        while candidates:
            other = candidates.pop(self.rng.randrange(len(candidates)))
            asked.add(other.peer_id)
            blocks = RemoteSpanInfo(other.peer_id, span.start, span.end, other.server_info)
            session = ServerSession(self.manager, blocks, inputs.shape[1])
            try:
                output = await session.step((inputs, prompts, None), str(uuid.uuid4()), None)
            except Exception as error:  # a failing verifier is not evidence against anyone
                logger.info(
                    "Server %s could not recompute blocks %d:%d: %s",
                    other.peer_id,
                    span.start,
                    span.end,
                    error,
                )
                self.manager.on_request_failure(other.peer_id)
                continue
            finally:
                await session.close()
            return other.peer_id, output[:, -length:], other.server_info.torch_dtype
        return None


def _name(peer: PeerID | None) -> str:
    return f"server {peer}" if peer is not None else "this client's own computation"


class LocalBlocks:
    """This client's own float32 copy of blocks, loaded on first use, when its model is a local
    checkpoint directory (``config.name_or_path``): a judge when no other server serves a span."""

    def __init__(self, config) -> None:
        self.config = config
        path = getattr(config, "name_or_path", "")
        self.available = bool(path) and Path(path).is_dir()
        self._blocks: dict[int, torch.nn.Module] = {}
        self._lock = threading.Lock()

    def run(self, start: int, end: int, inputs: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
        """Blocks ``[start, end)`` on ``inputs`` (every position, no cache); ``prompts`` per block or None."""
        hidden, shared = inputs.float(), {}  # one pass: see petals.block.shared_kv_kwargs
        with self._lock, torch.no_grad():
            for index in range(start, end):
                if index not in self._blocks:
                    self._blocks[index] = load_block(
                        self.config.name_or_path, index, torch.float32, config=self.config
                    )
                prompt = prompts[index - start].float() if prompts is not None else None
                block = self._blocks[index]
                hidden = block(add_prompt(hidden, prompt), None, **shared_kv_kwargs(block, shared))
        return hidden


_LOCAL_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_blocks(manager) -> LocalBlocks:
    if manager not in _LOCAL_BLOCKS:
        _LOCAL_BLOCKS[manager] = LocalBlocks(manager.config)
    return _LOCAL_BLOCKS[manager]
