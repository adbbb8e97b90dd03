"""Open inference sessions: their caches, position and inbox (found by session id for ``rpc_push``),
and the torch work of their steps, which runs in the compute thread.

Decode steps of several sessions over the same blocks run as one forward per block
(``run_decode_steps``), whatever their positions and batch sizes: each block's cache is the
sessions' caches merged (their page tables side by side over the block's pool): new keys and
values land in each session's own pages, and attention reads every row's pages (one gather per
block, left-padded to the longest row); no batch cache is built, and nothing is copied back.

Each session's pages are counted on its lease (``petals.kv_cache.lending``): every compute task of a
session first ``use``s it (an idle session is live again; one whose pages went to another session fails
with ``SessionPreempted``), and a step that grows a session may preempt a newer one, even one merged
into the same forward, which then fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from petals.kv_cache import CacheOverflowError, Lease, OutOfPagesError, SessionCache, SessionPreempted
from petals.server.backend import BlockBackend
from petals.tracing import NO_TRACE, StepTrace
from petals.wire_errors import WireError, shown

logger = logging.getLogger(__name__)


@dataclass
class ServerInferenceSession:
    """One client's stream on this server: a KV cache per block, fed by its client and by pushes."""

    session_id: str
    backends: list[BlockBackend]
    caches: list[SessionCache]
    batch_size: int
    max_length: int
    # requests from the client's stream and from pushes, with their arrival (perf_counter, when tracing);
    # the handler fills and reads it, the engine only ends it (``close``)
    inbox: asyncio.Queue[tuple[Any, float] | None] = field(default_factory=asyncio.Queue)
    done_steps: set[str] = field(default_factory=set)
    args_structure: object = None  # the first request's, for steps that send none
    lease: Lease | None = None  # its share of the server's cache pages (None: caches of their own)
    peer: str = ""  # the client's peer id: the owner of the sessions it keeps
    resumed_at: int | None = None  # where a session continuing a kept one starts (None: asked none)
    first_start: int | None = None  # where its first step starts (a continued session's rewind)

    def claim(self, step_id: object) -> bool:
        """False for a step this session already computed (a push and the client's copy race)."""
        if step_id is None:
            return True
        if step_id in self.done_steps:
            return False
        self.done_steps.add(step_id)
        return True

    @property
    def position(self) -> int:
        return self.caches[0].position

    @property
    def span_key(self) -> tuple:
        """Sessions with equal keys compute the same function of their inputs (blocks and adapter)."""
        return tuple((backend.uid, backend.adapter) for backend in self.backends)

    @property
    def preempted(self) -> bool:
        """Whether its pages went to another session (its steps fail with ``SessionPreempted``)."""
        return self.lease is not None and self.lease.preempted

    def close(self) -> None:
        """Ask the session's loop to finish (the loop frees the caches)."""
        self.inbox.put_nowait(None)

    def end(self, reason: str, keep: str | None = None) -> None:
        """Give the caches' pages back, or keep them under ``keep`` for the client to continue (in the
        compute thread, after the session's queued steps: no forward is using them then); logged."""
        lease, position = self.lease, self.position
        if lease is None:
            for cache in self.caches:
                cache.release()
            return
        pages = lease.total_pages
        kept = lease.lender.keep(lease, (self.peer, keep)) if keep is not None else 0
        if not kept:
            lease.lender.end(lease)
        logger.info(
            "Session %s of %s ended (%s) at position %d: %s",
            shown(self.session_id),
            self.peer[-6:] or "this process",
            reason,
            position,
            f"{kept} pages kept for its client" if kept else f"{pages} pages given back",
        )

    def lend(self) -> int:
        """Its client went silent: lend its pages until its next step (how many)."""
        return self.lease.lender.lend(self.lease) if self.lease is not None else 0

    # ---- compute (in the compute thread) -----------------------------------------------------

    def use(self) -> None:
        """About to compute: live again if idle, ``SessionPreempted`` if its pages went to another session."""
        if self.lease is not None:
            self.lease.use()

    def prepare(self, hypo_ids: torch.Tensor | None, start: int | None) -> None:
        """Rewind to ``start`` and reorder beams by ``hypo_ids`` before a step."""
        self.use()
        for cache in self.caches:
            if start is not None:
                cache.rewind(start)
            if hypo_ids is not None:
                cache.reorder(hypo_ids)

    def reserve(self, new_tokens: int) -> None:
        """Take the pages a step of ``new_tokens`` tokens needs on every block, before computing it."""
        for cache in self.caches:
            cache.reserve(new_tokens)

    def run_block(
        self, index: int, hidden: torch.Tensor, prompt: torch.Tensor | None, shared: dict | None = None
    ) -> torch.Tensor:
        """Block ``index`` of the span on this step's tokens; ``shared``: one dict per pass over the span
        (``BlockBackend.forward``)."""
        self.use()
        return self.backends[index].inference_step(hidden, prompt, self.caches[index].view(), shared)

    def run_blocks(self, hidden: torch.Tensor, prompts: list[torch.Tensor | None]) -> torch.Tensor:
        shared = {}
        with torch.inference_mode():
            for index, prompt in enumerate(prompts):
                hidden = self.run_block(index, hidden, prompt, shared)
        return hidden.cpu()


@dataclass
class DecodeStep:
    """A short step of one session without deep prompts: what the compute queue merges."""

    session: ServerInferenceSession
    hidden: torch.Tensor
    hypo_ids: torch.Tensor | None
    start: int | None
    trace: StepTrace = NO_TRACE  # timed when the request asked for a trace (PETALS_TRACE)


def run_decode_steps(steps: list[DecodeStep]) -> list[torch.Tensor | Exception]:
    """Run steps of sessions over the same blocks (as many new tokens each), one forward per block for all.

    A session whose rewind, reorder or pages fail gets its error as its result; the others run.
    """
    traces = [step.trace for step in steps if step.trace.enabled]
    for trace in traces:
        trace.mark("compute started")
    results = _run_decode_steps(steps, traces)
    for trace in traces:
        trace.mark("compute ended")
    return results


def _run_decode_steps(steps: list[DecodeStep], traces: list[StepTrace]) -> list[torch.Tensor | Exception]:
    results: list[torch.Tensor | Exception | None] = [None] * len(steps)
    ready = _each(steps, range(len(steps)), results, lambda step: step.session.use())  # idle ones first
    ready = _each(steps, ready, results, _prepare)
    for index in ready:  # a later session's pages may have made room for an earlier one's growth
        if steps[index].session.preempted:
            results[index] = SessionPreempted(steps[index].session.lease.preemption)
    ready = [index for index in ready if results[index] is None]
    if ready and steps[0].hidden.shape[1] > 0:  # not a pre-allocation or rewind-only step
        batch = [steps[index] for index in ready]
        hidden, shared = torch.cat([step.hidden for step in batch]), {}
        with torch.inference_mode():  # once for all blocks (see BlockBackend.inference_step)
            for block, backend in enumerate(batch[0].session.backends):
                started = time.perf_counter() if traces else 0.0
                caches = [step.session.caches[block] for step in batch]
                hidden = backend.inference_step(hidden, None, type(caches[0]).merged(caches), shared)
                _record_block(traces, backend, started)
        outputs = hidden.cpu().split([step.hidden.shape[0] for step in batch])
    else:
        outputs = [steps[index].hidden for index in ready]
    for index, output in zip(ready, outputs, strict=True):
        results[index] = output
    return results


def _prepare(step: DecodeStep) -> None:
    step.session.prepare(step.hypo_ids, step.start)
    step.session.reserve(step.hidden.shape[1])


def _each(steps: list[DecodeStep], indices, results: list, action) -> list[int]:
    """``action(step)`` for each step at ``indices``; a session whose rewind, reorder or pages fail gets
    its error as its result. Returns the indices of those that succeeded."""
    done = []
    for index in indices:
        try:
            action(steps[index])
            done.append(index)
        except (OutOfPagesError, CacheOverflowError, ValueError) as error:
            results[index] = error
    return done


def _record_block(traces: list[StepTrace], backend: BlockBackend, started: float) -> None:
    if traces:
        seconds = time.perf_counter() - started
        for trace in traces:
            trace.add(f"compute {backend.uid}", seconds)


class SessionRegistry:
    """Open sessions by id (``rpc_push`` finds them so)."""

    def __init__(self) -> None:
        self._sessions: dict[str, ServerInferenceSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: object) -> ServerInferenceSession | None:
        return self._sessions.get(session_id) if isinstance(session_id, str) else None

    def check_new(self, session_id: str) -> None:
        if session_id in self._sessions:
            raise WireError(f"session {shown(session_id)} is already open on this server")

    def add(self, session: ServerInferenceSession) -> None:
        self.check_new(session.session_id)
        self._sessions[session.session_id] = session

    def remove(self, session: ServerInferenceSession) -> None:
        self._sessions.pop(session.session_id, None)

    def close_all(self) -> None:
        for session in list(self._sessions.values()):
            session.close()
