"""Open inference sessions: their caches, position and inbox (found by session id for ``rpc_push``),
and the torch work of their steps, which runs in the compute thread.

Decode steps of several sessions over the same blocks run as one forward per block
(``run_decode_steps``), whatever their positions and batch sizes: each block's cache is the
sessions' caches merged (their page tables side by side over the block's pool): new keys and
values land in each session's own pages, and attention reads every row's pages (one gather per
block, left-padded to the longest row); no batch cache is built, and nothing is copied back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from petals.kv_cache import CacheOverflowError, OutOfPagesError, SessionCache
from petals.server.backend import BlockBackend
from petals.tracing import NO_TRACE, StepTrace
from petals.wire_errors import WireError, shown


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

    def close(self) -> None:
        """Ask the session's loop to finish (the loop frees the caches)."""
        self.inbox.put_nowait(None)

    def release(self) -> None:
        """Give the caches' pages back (in the compute thread: no forward is using them then)."""
        for cache in self.caches:
            cache.release()

    # ---- compute (in the compute thread) -----------------------------------------------------

    def prepare(self, hypo_ids: torch.Tensor | None, start: int | None) -> None:
        """Rewind to ``start`` and reorder beams by ``hypo_ids`` before a step."""
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
    ready = []
    for index, step in enumerate(steps):
        try:
            step.session.prepare(step.hypo_ids, step.start)
            step.session.reserve(step.hidden.shape[1])
            ready.append(index)
        except (OutOfPagesError, CacheOverflowError, ValueError) as error:
            results[index] = error
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
