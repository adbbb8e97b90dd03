"""Inference sessions: one ``rpc_inference`` stream per server span, with failover that replays history.

Every server session remembers the hidden states it was sent (``history``: the inputs of its first
block for every position so far). When a server fails or stalls, the session bans it, routes its
blocks again (minimum latency, enough KV cache) and sends the replacement the whole history plus the
current step as its first message, with the deep prompts that came with position 0 (prompt tuning),
so the replacement rebuilds exactly the cache the dead server had and answers for the same positions. If the blocks are split over several replacements, each one's replay output is the next
one's history. Positions never go out of step, so a healthy replacement is never blamed for the
dead server (Petals issue #587).

A server short of memory fails nobody: a session whose pages went to an older session (``[preempted]``)
or that found no room (``[cache_full]``) is replayed its history at once, in the server's line or where
there is room (``routing.judge_failure``), without a ban.

A session closed with ``keep`` (``close(keep=True)``, or on leaving its ``with`` block when opened with
``keep=True``) stays on its servers, its pages lent until it goes on, and keeps what it sent them here;
``reopen`` continues it, rolled back first wherever the next inputs differ (``KeptSessions`` does both for
``generate`` and ``petals api``). Its next step reopens each server's kept session
(``ServerSession.close``): a server that lent its pages meanwhile is sent what it lost, from the history.

A step may wait long (for the only server of some blocks, or a backoff between retries), and the thread
that runs it cannot be interrupted: ``cancel``, from any thread, ends the step in progress and every
later one with ``SessionCancelled`` (an API whose client has left frees its place this way).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from petals import tracing
from petals.client.routing import MissingBlocksError, RemoteSequenceManager
from petals.client.server_session import ServerSession, close_all, spawn
from petals.client.verification import Verifier
from petals.data_structures import RemoteSpanInfo
from petals.tracing import NO_TRACE, StepTrace
from petals.wire_errors import error_kind

logger = logging.getLogger(__name__)

ON_NETWORK_LOOP = "client: on network loop"  # the step's time on the loop thread (serialization, waits)


class SessionCancelled(RuntimeError):
    """The session was cancelled (``InferenceSession.cancel``): its step ended unfinished."""


@dataclass
class ChainPosition:
    """How far one step has come through the chain of server sessions."""

    index: int = 0  # the server session it goes to next
    block: int = 0  # the first block it has not passed yet
    attempt: int = 0  # failed tries since it last passed a server
    # the states of the session's earlier positions at ``block``: what a fresh server there must be replayed
    replay: torch.Tensor | None = None

    def passed(self, session: ServerSession, output: torch.Tensor, fresh: bool) -> torch.Tensor:
        """``session`` answered with ``output``: move past it; returns the step's states at the new block."""
        if fresh:  # the replayed positions come first in a fresh server's answer
            self.replay, output = output[:, : self.replay.shape[1]], output[:, self.replay.shape[1] :]
        else:
            self.replay = None
        self.block, self.index, self.attempt = session.span.end, self.index + 1, 0
        return output


class InferenceSession:
    """A multi-step inference session over all blocks of a ``RemoteSequenceManager``.

    Use as a context manager; ``step(hidden)`` sends ``[batch, n, hidden]`` states for ``n`` new
    positions through all blocks and returns the last block's outputs.
    """

    def __init__(self, manager: RemoteSequenceManager, max_length: int, keep: bool = False) -> None:
        self.manager, self.max_length = manager, max_length
        self.keep = keep  # leaving the ``with`` block without an error closes it with keep
        self.kept = False  # closed with keep: ``reopen`` continues it
        self._key = uuid.uuid4().hex  # its servers keep it under this key (and their blocks)
        self.position = 0
        self.output_ids: torch.Tensor | None = None  # tokens seen so far (kept by generate)
        self.pending_hypo_ids: torch.Tensor | None = None  # a beam reorder for the next step
        self._sessions: list[ServerSession] = []
        self._first_prompts: torch.Tensor | None = None  # deep prompts of position 0, replayed on failover
        self.prompt_length = 0  # trainable prompt positions in front of the tokens (set by the model)
        self._closed = False
        self._traced_steps: list[dict[str, float]] = []  # with tracing on: logged when the session closes
        self._last_step_end: float | None = None
        self._verifier = Verifier(manager, manager.config.verify)
        self._cancelled = False
        self._running: asyncio.Task | None = None  # the step in progress, on the network loop

    def cancel(self) -> None:
        """From any thread: end the step in progress, and every later one, with ``SessionCancelled``. A
        closed session has nothing to cancel: one kept for a later request is not cancelled by the
        request that ended (an API's client that leaves once its answer is complete)."""
        if self._closed:
            return
        self._cancelled = True
        with contextlib.suppress(RuntimeError):  # the network has already left: no step can be running
            self.manager.network.loop.call_soon_threadsafe(self._cancel_running)

    def _cancel_running(self) -> None:
        if self._running is not None:
            self._running.cancel()

    @property
    def route(self) -> list[RemoteSpanInfo]:
        return [session.span for session in self._sessions]

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(keep=self.keep and exc_type is None)

    def close(self, keep: bool = False) -> None:
        """Close the session on every server; with ``keep``, each server keeps it (its pages lent until
        then) for ``reopen`` to continue, and so does this object (what it sent them). A session whose
        servers are out of step (a step failed half-way) or that was cancelled is closed for good."""
        if self._closed:
            return
        self._closed = True
        keep = keep and not self._cancelled and all(s.position == self.position for s in self._sessions)
        sessions = self._sessions if keep else []
        sessions, self._sessions = self._sessions, sessions
        self.manager.network.run(close_all(sessions, self._key if keep else None), timeout=30)
        self.kept = keep
        tracing.log_session(self._traced_steps)
        self._traced_steps = []

    def reopen(self, max_length: int) -> None:
        """Continue a session closed with ``keep``, now for up to ``max_length`` positions: its next step
        reopens it on each server (``rollback`` first to go on from an earlier position)."""
        if not self.kept:
            raise RuntimeError("only a session closed with keep can be reopened")
        if max_length < self.position:
            raise ValueError(f"max_length {max_length} is less than the {self.position} positions kept")
        self._closed, self.kept, self.max_length = False, False, max_length
        for session in self._sessions:
            session.max_length = max_length

    @property
    def tokens(self) -> int:
        """Positions the servers hold for the tokens generated so far (``output_ids``), prompts excluded."""
        return self.position - self.prompt_length

    def rollback(self, position: int) -> None:
        """Go back to ``position``: the next step overwrites everything from there on, on every server.

        Nothing is sent now: the next step carries the original Petals' ``start_from_position``, and a
        replacement after a failover is replayed only the history up to ``position``. A server that cannot
        go back to ``position`` (fixed-size states) goes back further and is sent the positions between
        again with that step (``ServerSession.rollback``).
        """
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot roll back to position {position}: the session is at {self.position}")
        self.position = position
        for session in self._sessions:
            session.rollback(position)
        if self.output_ids is not None:
            self.output_ids = self.output_ids[:, : max(0, position - self.prompt_length)]

    def step(
        self, hidden: torch.Tensor, prompts: torch.Tensor | None = None, hypo_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("this inference session is closed")
        if self._cancelled:
            raise SessionCancelled("this inference session was cancelled")
        if hidden.ndim != 3:
            raise ValueError(
                f"hidden states must have shape [batch, length, hidden], got {list(hidden.shape)}"
            )
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"the session's max_length {self.max_length} is exceeded: {self.position} tokens so far + "
                f"{hidden.shape[1]} new; open the session with a larger max_length"
            )
        if hypo_ids is None:
            hypo_ids, self.pending_hypo_ids = self.pending_hypo_ids, None
        if prompts is not None and prompts.numel() and prompts.shape[0] != len(self.manager):
            raise ValueError(
                f"deep prompts must have {len(self.manager)} blocks, got shape {list(prompts.shape)}"
            )
        device, dtype = hidden.device, hidden.dtype
        inputs = hidden.detach().cpu()
        hypo_ids = hypo_ids.detach().cpu().to(torch.int64) if hypo_ids is not None else None
        prompts = prompts.detach().cpu() if prompts is not None and prompts.numel() else None
        log = tracing.client_log
        if log is None:
            output = self._run(self._step(inputs, prompts, hypo_ids))
        else:
            output = self._traced_step(log, inputs, prompts, hypo_ids)
        self.position += hidden.shape[1]
        return output.to(device=device, dtype=dtype)

    def _traced_step(
        self,
        log: tracing.StepLog,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """``_step`` with its time split up; the gap since the previous step is the client's own compute."""
        trace = log.take_pending()
        started = time.perf_counter()
        if self._last_step_end is not None:
            own = started - self._last_step_end - trace.times.get("client: embeddings", 0.0)
            trace.add("client: LM head + generate logic", own)
        output = self._run(self._step(hidden, prompts, hypo_ids, trace))
        self._last_step_end = time.perf_counter()
        total = self._last_step_end - started
        trace.add("client: thread hand-off", total - trace.times[ON_NETWORK_LOOP])
        trace.add("client: step total", total)
        log.steps.append(trace.times)
        self._traced_steps.append(trace.times)
        return output

    def _run(self, step: Coroutine[Any, Any, torch.Tensor]) -> torch.Tensor:
        """``step`` on the network loop; ``SessionCancelled`` if ``cancel`` ended it."""
        try:
            return self.manager.network.run(step)
        except concurrent.futures.CancelledError:
            if self._cancelled:
                raise SessionCancelled("this inference session was cancelled during a step") from None
            raise

    async def _step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        trace: StepTrace = NO_TRACE,
    ) -> torch.Tensor:
        started = trace.now()
        if self._cancelled:  # cancelled after the step was sent to the loop, before it started
            raise asyncio.CancelledError
        self._running = asyncio.current_task()
        try:
            return await self._run_step(hidden, prompts, hypo_ids, trace)
        finally:
            self._running = None
            trace.add_since(ON_NETWORK_LOOP, started)

    async def _run_step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        trace: StepTrace,
    ) -> torch.Tensor:
        """The step through every block: server session after server session, failing over where one fails."""
        if hypo_ids is not None:
            for session in self._sessions:
                session.reorder(hypo_ids)
            if self._first_prompts is not None and self._first_prompts.shape[1] > 1:
                self._first_prompts = self._first_prompts[:, hypo_ids]
        if self.position == 0:
            self._first_prompts = prompts
        step_id = str(uuid.uuid4())
        self.manager.refresh_membership_in_background()  # revocations reach this route (may_use below)
        at = ChainPosition()
        while at.block < len(self.manager):
            if self._cancelled:  # also where a library swallowed the task's cancellation
                raise asyncio.CancelledError
            try:
                if at.index == len(self._sessions):
                    self._sessions.extend(await self._open(at.block, len(self.manager), hidden))
                session = self._sessions[at.index]
                if not self.manager.may_use(session.span.peer_id):
                    span = session.span
                    logger.warning(
                        "Server %s may no longer be used (certificate revoked or expired); routing blocks %d:%d anew",
                        span.peer_id,
                        span.start,
                        span.end,
                    )
                    await self._replace(at, session)
                    continue
                fresh = session.position == 0 and self.position > 0
                verified = not fresh and self._verifier.sample()
                tensors = (hidden, prompts, hypo_ids)
                output = await self._step_on(session, at, fresh, tensors, step_id, trace, verified)
                self.manager.on_request_success(session.span.peer_id)
                if verified and await self._caught_lying(session, output):
                    await self._replace(at, session)  # the step is recomputed by the replacement
                    continue
                hidden = at.passed(session, output, fresh)
            except MissingBlocksError:
                raise
            except Exception as error:
                await self._fail_over(at, error)
        return hidden

    async def _step_on(
        self,
        session: ServerSession,
        at: ChainPosition,
        fresh: bool,
        tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        step_id: str,
        trace: StepTrace,
        verified: bool = False,
    ) -> torch.Tensor:
        """The step on ``session``; a fresh one (a replacement) gets the session's history replayed first.
        A step to be verified is not pushed on: the next server must get the output only once checked."""
        hidden, prompts, hypo_ids = tensors
        span = session.span
        if fresh:
            if at.replay is None:
                raise RuntimeError(f"no history to replay for blocks {span.start}:{span.end}")
            # a replay starts at position 0, so it carries the deep prompts sent with position 0
            hidden, prompts, hypo_ids = torch.cat([at.replay, hidden], dim=1), self._first_prompts, None
        next_servers = None if fresh or verified else self._next_servers(at.index)
        name = _server_name(at.index, len(self._sessions))
        while True:
            if not fresh and session.resent_from == 0:  # the session sends its history again, from 0
                prompts = self._first_prompts
            span_prompts = prompts[span.start : span.end] if prompts is not None else None
            output = await session.step((hidden, span_prompts, hypo_ids), step_id, next_servers, trace, name)
            if output is not None:
                return output
            # a kept session its server holds less of: sent again from there (a step id of its own: the
            # server has claimed the first one)
            logger.info(
                "Server %s held %d positions of this session on blocks %d:%d; sending it the %d after them",
                span.peer_id,
                session.resent_from,
                span.start,
                span.end,
                session.position - session.resent_from,
            )
            step_id, next_servers = str(uuid.uuid4()), None

    async def _open(self, start: int, end: int, hidden: torch.Tensor) -> list[ServerSession]:
        """Sessions on a route for blocks ``[start, end)``; on a new route with pushes on, all opened at once."""
        spans = await self.manager.make_sequence(
            start, end, mode="min_latency", cache_tokens_needed=self.max_length
        )
        sessions = [ServerSession(self.manager, span, self.max_length) for span in spans]
        if self.position == 0 and len(sessions) > 1 and self.manager.config.use_server_to_server:
            batch_size, _, hidden_size = hidden.shape
            await asyncio.gather(
                *(session.open_ahead(batch_size, hidden_size, hidden.dtype) for session in sessions)
            )
        return sessions

    async def _fail_over(self, at: ChainPosition, error: BaseException) -> None:
        """Drop the failed server session (the step routes its blocks anew from ``at``), or raise
        ``error`` when the retry policy says that retrying cannot help. A server out of memory is no
        failure: the session is replayed at once, and no attempt is counted."""
        failed = self._sessions[at.index] if at.index < len(self._sessions) else None
        verdict = await self.manager.handle_failure(
            error, failed.span.peer_id if failed is not None else None, at.attempt
        )
        at.attempt += verdict.wait is None
        if failed is None:  # routing itself failed
            logger.warning("Routing failed (%s); retrying", error)
            return
        span = failed.span
        if verdict.wait is None:
            logger.warning(
                "Server %s failed on blocks %d:%d (%s: %s); routing around it",
                span.peer_id,
                span.start,
                span.end,
                type(error).__name__,
                error,
            )
        else:
            logger.info(
                "Server %s had no room for this session on blocks %d:%d (%s); sending its %d positions again",
                span.peer_id,
                span.start,
                span.end,
                error_kind(str(error)),
                failed.position,
            )
        await self._replace(at, failed)

    async def _replace(self, at: ChainPosition, failed: ServerSession) -> None:
        """Route ``failed``'s blocks anew; the replacement is replayed what ``failed`` had seen."""
        span = failed.span
        if failed.position > 0:
            at.replay = failed.history  # what the failed server had seen: the replacement rebuilds from it
        spans = await self.manager.make_sequence(
            span.start, span.end, mode="min_latency", cache_tokens_needed=self.max_length
        )
        self._sessions[at.index : at.index + 1] = [
            ServerSession(self.manager, s, self.max_length) for s in spans
        ]
        spawn(failed.close())

    async def _caught_lying(self, session: ServerSession, output: torch.Tensor) -> bool:
        """Whether ``session``'s server lied in the step it just answered with ``output`` (``verification``);
        if so, the step is taken back from its session."""
        span = session.span
        prompts = self._first_prompts[span.start : span.end] if self._first_prompts is not None else None
        liar = await self._verifier.judge(span, session.history, prompts, output)
        if liar != span.peer_id:
            return False
        session.rollback(session.position - output.shape[1])
        return True

    def _next_servers(self, index: int) -> list[list[Any]] | None:
        """Downstream sessions that already hold this session's past, for server-to-server pushes.

        The chain stops before the first hop where a push would arrive later than the client's copy.
        """
        if not self.manager.config.use_server_to_server:
            return None
        downstream = self._sessions[index + 1 :]
        if not downstream or any(session.position != self.position for session in downstream):
            return None
        sender = self._sessions[index]
        if sender.resent_from is not None or sender.resuming:  # its output is longer, or may be empty
            return None
        chain = []
        for sender, receiver in zip(self._sessions[index:], downstream, strict=False):
            peer = receiver.span.peer_id
            if receiver.resent_from is not None or receiver.resuming:  # the client sends it its step
                break
            if not self.manager.may_use(peer) or not self.manager.push_pays(sender.span, peer):
                break
            chain.append(
                [
                    receiver.span.peer_id.to_base58(),
                    receiver.session_id,
                    receiver.span.start,
                    receiver.span.end,
                ]
            )
        return chain or None


def _server_name(index: int, count: int) -> str:
    """How a trace names the server at ``index`` of ``count`` on the route."""
    return f"server {index + 1}/{count}"
