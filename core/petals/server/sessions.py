"""Open inference sessions: their caches, position and inbox (found by session id for ``rpc_push``),
and the torch work of their steps, which runs in the compute thread.

Decode steps of several sessions over the same blocks and at the same position run as one forward
per block (``run_decode_steps``): their caches are stacked into one batch for the block, and the
new keys and values are copied back into each session's own cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from hivemind.proto import runtime_pb2

from petals.kv_cache import BlockCache
from petals.server.backend import BlockBackend
from petals.tracing import StepTrace


@dataclass
class InferenceSession:
    """One client's stream on this server: a KV cache per block, fed by its client and by pushes."""

    session_id: str
    backends: list[BlockBackend]
    caches: list[BlockCache]
    batch_size: int
    max_length: int
    # requests from the client's stream and from pushes, with their arrival (perf_counter, when tracing)
    inbox: asyncio.Queue[tuple[runtime_pb2.ExpertRequest, float] | None] = field(
        default_factory=asyncio.Queue
    )
    done_steps: set[str] = field(default_factory=set)

    @property
    def position(self) -> int:
        return self.caches[0].position

    @property
    def span_key(self) -> tuple:
        """Sessions with equal keys compute the same function of their inputs (blocks and adapter)."""
        return tuple((backend.uid, backend.adapter) for backend in self.backends)

    @property
    def stackable(self) -> bool:
        """Whether its steps can share a forward with other sessions' (plain caches, not sharded ones)."""
        return all(isinstance(cache, BlockCache) for cache in self.caches)

    def close(self) -> None:
        """Ask the session's loop to finish (the loop frees the caches)."""
        self.inbox.put_nowait(None)

    # ---- compute (in the compute thread) -----------------------------------------------------

    def prepare(self, hypo_ids: torch.Tensor | None, start: int | None) -> None:
        """Rewind to ``start`` and reorder beams by ``hypo_ids`` before a step."""
        for cache in self.caches:
            if start is not None:
                cache.rewind(start)
            if hypo_ids is not None:
                cache.reorder(hypo_ids)

    def run_block(self, index: int, hidden: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
        return self.backends[index].inference_step(hidden, prompt, self.caches[index])

    def run_blocks(
        self, hidden: torch.Tensor, prompts: list[torch.Tensor | None], traces: list[StepTrace] = ()
    ) -> torch.Tensor:
        for index, prompt in enumerate(prompts):
            started = time.perf_counter() if traces else 0.0
            hidden = self.run_block(index, hidden, prompt)
            _record_block(traces, self.backends[index], started)
        return hidden.cpu()


@dataclass
class DecodeStep:
    """A short step of one session without deep prompts: what the compute queue merges."""

    session: InferenceSession
    hidden: torch.Tensor
    hypo_ids: torch.Tensor | None
    start: int | None
    trace: StepTrace | None = None  # timed when the request asked for a trace (PETALS_TRACE)


def run_decode_steps(steps: list[DecodeStep]) -> list[torch.Tensor]:
    """Run same-position steps of sessions over the same blocks, one forward per block for all."""
    traces = [step.trace for step in steps if step.trace is not None]
    for trace in traces:
        trace.mark("compute started")
    outputs = _run_decode_steps(steps, traces)
    for trace in traces:
        trace.mark("compute ended")
    return outputs


def _run_decode_steps(steps: list[DecodeStep], traces: list[StepTrace]) -> list[torch.Tensor]:
    for step in steps:
        step.session.prepare(step.hypo_ids, step.start)
    if steps[0].hidden.shape[1] == 0:  # a pre-allocation or rewind-only step
        return [step.hidden for step in steps]
    if len(steps) == 1 or not steps[0].session.stackable:
        return [
            step.session.run_blocks(step.hidden, [None] * len(step.session.backends), _own(step))
            for step in steps
        ]
    sizes = [step.hidden.shape[0] for step in steps]
    hidden = torch.cat([step.hidden for step in steps])
    for index, backend in enumerate(steps[0].session.backends):
        started = time.perf_counter() if traces else 0.0
        caches = [step.session.caches[index] for step in steps]
        stacked = stack_caches(caches, hidden.shape[1])
        hidden = backend.inference_step(hidden, None, stacked)
        unstack_caches(stacked, caches)
        _record_block(traces, backend, started)
    return list(hidden.cpu().split(sizes))


def _own(step: DecodeStep) -> list[StepTrace]:
    return [step.trace] if step.trace is not None else []


def _record_block(traces: list[StepTrace], backend: BlockBackend, started: float) -> None:
    if traces:
        seconds = time.perf_counter() - started
        for trace in traces:
            trace.add(f"compute {backend.uid}", seconds)


def stack_caches(caches: list[BlockCache], new_tokens: int) -> BlockCache:
    """One cache holding ``caches`` (all at the same position) along the batch, with room for the step."""
    first = caches[0].layer
    position = first.length
    stacked = BlockCache(
        caches[0].layout,
        sum(cache.num_sequences for cache in caches),
        position + new_tokens,
        first.keys.dtype,
        first.keys.device,
    )
    row = 0
    for cache in caches:
        rows = slice(row, row + cache.num_sequences)
        stacked.layer.keys[rows, :, :position] = cache.layer.keys[:, :, :position]
        stacked.layer.values[rows, :, :position] = cache.layer.values[:, :, :position]
        row += cache.num_sequences
    stacked.layer.length = position
    return stacked


def unstack_caches(stacked: BlockCache, caches: list[BlockCache]) -> None:
    """Copy the keys and values a step added to ``stacked`` back into each session's cache."""
    start, end, row = caches[0].position, stacked.position, 0
    for cache in caches:
        rows = slice(row, row + cache.num_sequences)
        cache.layer.keys[:, :, start:end] = stacked.layer.keys[rows, :, start:end]
        cache.layer.values[:, :, start:end] = stacked.layer.values[rows, :, start:end]
        cache.layer.length = end
        row += cache.num_sequences


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[str, InferenceSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: object) -> InferenceSession | None:
        return self._sessions.get(session_id) if isinstance(session_id, str) else None

    @contextmanager
    def registered(self, session: InferenceSession) -> Iterator[InferenceSession]:
        if session.session_id in self._sessions:
            raise ValueError(f"session {session.session_id!r} is already open on this server")
        self._sessions[session.session_id] = session
        try:
            yield session
        finally:
            del self._sessions[session.session_id]
            session.caches.clear()

    def close_all(self) -> None:
        for session in list(self._sessions.values()):
            session.close()
