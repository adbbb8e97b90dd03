"""Inference sessions: one ``rpc_inference`` stream per server span, with failover that replays history.

Every server session remembers the hidden states it was sent (``history``: the inputs of its first
block for every position so far). When a server fails or stalls, the session bans it, routes its
blocks again (minimum latency, enough KV cache) and sends the replacement the whole history plus the
current step as its first message, with the deep prompts that came with position 0 (prompt tuning),
so the replacement rebuilds exactly the cache the dead server had and answers for the same positions. If the blocks are split over several replacements, each one's replay output is the next
one's history. Positions never go out of step, so a healthy replacement is never blamed for the
dead server (Petals issue #587).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from petals import tracing
from petals.client.routing import MissingBlocksError, RemoteSequenceManager, ServerMisbehaved
from petals.data_structures import RemoteSpanInfo
from petals.network.rpc import open_inference_stream
from petals.wire import deserialize_tensor, pack_args_kwargs, read_metadata, serialize_tensor, write_metadata

logger = logging.getLogger(__name__)

EMPTY = torch.empty(0)
EMPTY_IDS = torch.empty(0, dtype=torch.int64)
# one step's (hidden states, deep prompts or None, beam reorder ids or None)
StepTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# most steps send no prompts and no hypo_ids: their placeholders are serialized once
EMPTY_PROTO, EMPTY_IDS_PROTO = serialize_tensor(EMPTY), serialize_tensor(EMPTY_IDS)
ON_NETWORK_LOOP = "client: on network loop"  # the step's time on the loop thread (serialization, waits)


class _ServerSession:
    """One open ``rpc_inference`` stream to the server computing ``span`` (blocks ``[start, end)``)."""

    def __init__(self, manager: RemoteSequenceManager, span: RemoteSpanInfo, max_length: int) -> None:
        self.manager, self.span, self.max_length = manager, span, max_length
        self.session_id = str(uuid.uuid4())
        self._history: list[torch.Tensor] = []  # everything this server was sent, step by step
        self.position = 0
        self._start_from: int | None = None  # a rollback the server learns with the next step
        self._requests: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self._responses: AsyncIterator[runtime_pb2.ExpertResponse] | None = None
        self._opening_sent = False  # the first request carries the session's parameters
        self._unanswered = 0  # answers to skip before the next step's: the empty opening step's
        self._open_error: BaseException | None = None  # from opening ahead, raised by the first step

    async def open_ahead(self, batch_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Open the stream and the server's session now, with an empty step (legal in Petals' protocol:
        it allocates without computing), and do not wait for its answer. All servers of a route
        are opened this way at once, so the first step can already be pushed from server to server.
        A failure is kept and raised by the first step, which then fails over as usual."""
        try:
            empty = torch.empty(batch_size, 0, hidden_size, dtype=dtype)
            request = self._request((empty, None, None), str(uuid.uuid4()), None, False)
            await self._open_stream()
            self._requests.put_nowait(request)
            self._unanswered += 1
        except Exception as error:
            self._open_error, self._opening_sent = error, False

    @property
    def history(self) -> torch.Tensor | None:
        """``[batch, position, hidden]``: the inputs of this span's first block so far."""
        if len(self._history) > 1:
            self._history = [torch.cat(self._history, dim=1)]
        return self._history[0] if self._history else None

    async def _request_stream(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def step(
        self,
        tensors: StepTensors,
        step_id: str,
        next_servers: list[list[Any]] | None,
        trace: tracing.StepTrace | None = None,
        name: str = "server",
    ) -> torch.Tensor:
        """One step on this server: ``tensors`` are its ``(hidden, prompts, hypo_ids)``."""
        started = time.perf_counter() if trace is not None else 0.0
        hidden = tensors[0]
        request = self._request(tensors, step_id, next_servers, trace is not None)
        if trace is not None:
            started = trace.add_since("client: serialization", started)
        response = await self._exchange(request, tokens=hidden.shape[0] * hidden.shape[1])
        if trace is not None:
            trace.add_since(f"client: wait for {name}", started)
            self._record_server_trace(response, trace, name)
            started = time.perf_counter()
        output = self._accept(response, hidden)
        if trace is not None:
            trace.add_since("client: serialization", started)
        return output.to(hidden.dtype)

    def _request(
        self,
        tensors: StepTensors,
        step_id: str,
        next_servers: list[list[Any]] | None,
        traced: bool,
    ) -> runtime_pb2.ExpertRequest:
        """The message of one step, from its ``(hidden, prompts, hypo_ids)``; the stream's first one
        also opens the server's session."""
        hidden, prompts, hypo_ids = tensors
        _, args_structure = pack_args_kwargs(
            hidden, EMPTY if prompts is None else prompts, EMPTY_IDS if hypo_ids is None else hypo_ids
        )
        protos = [
            serialize_tensor(hidden),
            EMPTY_PROTO if prompts is None else serialize_tensor(prompts),
            EMPTY_IDS_PROTO if hypo_ids is None else serialize_tensor(hypo_ids),
        ]
        metadata: dict[str, Any] = {
            "session_id": self.session_id,
            "step_id": step_id,
            "args_structure": args_structure,
        }
        if not self._opening_sent:
            self._opening_sent = True
            config = self.manager.config
            metadata.update(max_length=self.max_length, points=0.0, active_adapter=config.active_adapter)
        if self._start_from is not None:
            metadata["start_from_position"] = self._start_from
        if next_servers:
            metadata["next_servers"] = next_servers
        if traced:
            metadata["trace"] = True
        return runtime_pb2.ExpertRequest(
            uid=self.manager.chain_uid(self.span.start, self.span.end),
            tensors=protos,
            metadata=write_metadata(metadata),
        )

    async def _exchange(self, request: runtime_pb2.ExpertRequest, tokens: int) -> runtime_pb2.ExpertResponse:
        """Send ``request`` (opening the stream first) and wait for its answer within the step deadline."""
        if self._open_error is not None:
            error, self._open_error = self._open_error, None
            raise error
        await self._open_stream()
        deadlines = self.manager.step_deadlines
        sent = time.perf_counter()
        self._requests.put_nowait(request)
        async with asyncio.timeout(deadlines.deadline(self.span.peer_id, tokens)):
            while self._unanswered:  # the opening step's answer comes first: nothing to read in it
                await anext(self._responses)
                self._unanswered -= 1
            response = await anext(self._responses)
        deadlines.observe(self.span.peer_id, tokens, time.perf_counter() - sent)
        return response

    async def _open_stream(self) -> None:
        if self._responses is None:
            self._responses = await asyncio.wait_for(
                open_inference_stream(self.manager.network.p2p, self.span.peer_id, self._request_stream()),
                self.manager.config.connect_timeout,
            )

    def _accept(self, response: runtime_pb2.ExpertResponse, hidden: torch.Tensor) -> torch.Tensor:
        """The server's output for ``hidden``, checked; the step now counts as done on this server."""
        if len(response.tensors) != 1:
            raise ServerMisbehaved(
                f"server {self.span.peer_id} answered an inference step with {len(response.tensors)} tensors"
            )
        output = deserialize_tensor(response.tensors[0])
        if output.shape != hidden.shape:
            raise ServerMisbehaved(
                f"server {self.span.peer_id} returned shape {list(output.shape)} for {list(hidden.shape)}"
            )
        self._history.append(hidden)
        self.position += hidden.shape[1]
        self._start_from = None
        return output

    @staticmethod
    def _record_server_trace(
        response: runtime_pb2.ExpertResponse, trace: tracing.StepTrace, name: str
    ) -> None:
        """The server's own timings of this step, when it traces (``PETALS_TRACE`` on the server too)."""
        try:
            times = read_metadata(response.metadata).get("server_trace")
        except ValueError:
            return
        if isinstance(times, dict):
            trace.merge(f"{name}: ", {k: v for k, v in times.items() if isinstance(v, int | float)})

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        if self._history:
            self._history = [self.history[hypo_ids]]

    def rollback(self, position: int) -> None:
        """Forget the positions from ``position`` on; the next step tells the server (``start_from_position``)."""
        if position < self.position:
            self._history = [self.history[:, :position]] if position else []
            self.position = self._start_from = position

    async def close(self) -> None:
        """End the stream politely (an empty request) without waiting for the server's end of it.

        The server frees the session's cache when it reads the end of the stream; waiting for its
        answer would cost the caller a round trip per generation, so the answer is drained in the
        background (for at most a second: a dead server never answers).
        """
        if self._responses is None:
            return
        self._requests.put_nowait(runtime_pb2.ExpertRequest())
        self._requests.put_nowait(None)
        responses, self._responses = self._responses, None
        task = asyncio.ensure_future(_drain_briefly(responses))
        _DRAINING.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(_DRAINING.discard)


async def _close_all(sessions: list[_ServerSession]) -> None:
    await asyncio.gather(*(session.close() for session in sessions))


_DRAINING: set[asyncio.Task] = set()


async def _drain_briefly(responses: AsyncIterator) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(_drain(responses), 1.0)


async def _drain(responses: AsyncIterator) -> None:
    async for _ in responses:
        pass


class InferenceSession:
    """A multi-step inference session over all blocks of a ``RemoteSequenceManager``.

    Use as a context manager; ``step(hidden)`` sends ``[batch, n, hidden]`` states for ``n`` new
    positions through all blocks and returns the last block's outputs.
    """

    def __init__(self, manager: RemoteSequenceManager, max_length: int) -> None:
        self.manager, self.max_length = manager, max_length
        self.position = 0
        self.output_ids: torch.Tensor | None = None  # tokens seen so far (kept by generate)
        self.pending_hypo_ids: torch.Tensor | None = None  # a beam reorder for the next step
        self._sessions: list[_ServerSession] = []
        self._first_prompts: torch.Tensor | None = None  # deep prompts of position 0, replayed on failover
        self.prompt_length = 0  # trainable prompt positions in front of the tokens (set by the model)
        self._closed = False
        self._traced_steps: list[dict[str, float]] = []  # with tracing on: logged when the session closes
        self._last_step_end: float | None = None

    @property
    def route(self) -> list[RemoteSpanInfo]:
        return [session.span for session in self._sessions]

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            sessions, self._sessions = self._sessions, []
            self.manager.network.run(_close_all(sessions), timeout=30)
            tracing.log_session(self._traced_steps)

    def rollback(self, position: int) -> None:
        """Go back to ``position``: the next step overwrites everything from there on, on every server.

        Nothing is sent now: the next step carries the original Petals' ``start_from_position``, and a
        replacement after a failover is replayed only the history up to ``position``.
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
            output = self.manager.network.run(self._step(inputs, prompts, hypo_ids))
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
        output = self.manager.network.run(self._step(hidden, prompts, hypo_ids, trace))
        self._last_step_end = time.perf_counter()
        total = self._last_step_end - started
        trace.add("client: thread hand-off", total - trace.times[ON_NETWORK_LOOP])
        trace.add("client: step total", total)
        log.steps.append(trace.times)
        self._traced_steps.append(trace.times)
        return output

    async def _step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        trace: tracing.StepTrace | None = None,
    ) -> torch.Tensor:
        if trace is None:
            return await self._run_step(hidden, prompts, hypo_ids, None)
        started = time.perf_counter()
        try:
            return await self._run_step(hidden, prompts, hypo_ids, trace)
        finally:
            trace.add_since(ON_NETWORK_LOOP, started)

    async def _run_step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        trace: tracing.StepTrace | None,
    ) -> torch.Tensor:
        if hypo_ids is not None:
            for session in self._sessions:
                session.reorder(hypo_ids)
            if self._first_prompts is not None and self._first_prompts.shape[1] > 1:
                self._first_prompts = self._first_prompts[:, hypo_ids]
        if self.position == 0:
            self._first_prompts = prompts
        step_id = str(uuid.uuid4())
        num_blocks = len(self.manager)
        replay: torch.Tensor | None = (
            None  # earlier positions' states at the current boundary, for a fresh server
        )
        index, block, attempt = 0, 0, 0
        while block < num_blocks:
            try:
                if index == len(self._sessions):
                    self._sessions.extend(await self._open(block, num_blocks, hidden))
                session = self._sessions[index]
                fresh = session.position == 0 and self.position > 0
                if fresh and replay is None:
                    raise RuntimeError(
                        f"no history to replay for blocks {session.span.start}:{session.span.end}"
                    )
                inputs = torch.cat([replay, hidden], dim=1) if fresh else hidden
                # a replay starts at position 0, so it carries the deep prompts sent with position 0
                step_prompts = self._first_prompts if fresh else prompts
                span_prompts = (
                    step_prompts[session.span.start : session.span.end] if step_prompts is not None else None
                )
                output = await session.step(
                    (inputs, span_prompts, None if fresh else hypo_ids),
                    step_id,
                    None if fresh else self._next_servers(index),
                    trace,
                    _server_name(index, len(self._sessions)),
                )
                self.manager.on_request_success(session.span.peer_id)
                if fresh:
                    replay, hidden = output[:, : replay.shape[1]], output[:, replay.shape[1] :]
                else:
                    replay, hidden = None, output
                block = session.span.end
                index += 1
                attempt = 0
            except MissingBlocksError:
                raise
            except Exception as error:
                replay = await self._fail_over(index, replay, error, attempt)
                attempt += 1
        return hidden

    async def _open(self, start: int, end: int, hidden: torch.Tensor) -> list[_ServerSession]:
        """Sessions on a route for blocks ``[start, end)``; on a new route with pushes on, all opened at once."""
        spans = await self.manager.make_sequence(
            start, end, mode="min_latency", cache_tokens_needed=self.max_length
        )
        sessions = [_ServerSession(self.manager, span, self.max_length) for span in spans]
        if self.position == 0 and len(sessions) > 1 and self.manager.config.use_server_to_server:
            batch_size, _, hidden_size = hidden.shape
            await asyncio.gather(
                *(session.open_ahead(batch_size, hidden_size, hidden.dtype) for session in sessions)
            )
        return sessions

    async def _fail_over(
        self, index: int, replay: torch.Tensor | None, error: BaseException, attempt: int
    ) -> torch.Tensor | None:
        """Drop the failed server session (the next loop iteration routes its blocks anew), or raise
        ``error`` when the retry policy says that retrying cannot help."""
        failed = self._sessions[index] if index < len(self._sessions) else None
        await self.manager.handle_failure(error, failed.span.peer_id if failed is not None else None, attempt)
        if failed is None:  # routing itself failed
            logger.warning("Routing failed (%s); retrying", error)
            return replay
        logger.warning(
            "Server %s failed on blocks %d:%d (%s: %s); routing around it",
            failed.span.peer_id,
            failed.span.start,
            failed.span.end,
            type(error).__name__,
            error,
        )
        if failed.position > 0:
            replay = failed.history  # what the failed server had seen: the replacement rebuilds from it
        spans = await self.manager.make_sequence(
            failed.span.start, failed.span.end, mode="min_latency", cache_tokens_needed=self.max_length
        )
        self._sessions[index : index + 1] = [
            _ServerSession(self.manager, span, self.max_length) for span in spans
        ]
        asyncio.ensure_future(failed.close())
        return replay

    def _next_servers(self, index: int) -> list[list[Any]] | None:
        """Downstream sessions that already hold this session's past, for server-to-server pushes.

        The chain stops before the first hop where a push would arrive later than the client's copy.
        """
        if not self.manager.config.use_server_to_server:
            return None
        downstream = self._sessions[index + 1 :]
        if not downstream or any(session.position != self.position for session in downstream):
            return None
        chain = []
        for sender, receiver in zip(self._sessions[index:], downstream, strict=False):
            if not self.manager.push_pays(sender.span, receiver.span.peer_id):
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
