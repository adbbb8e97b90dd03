"""One server's part of an inference session: an ``rpc_inference`` stream and the history it was sent.

A ``ServerSession`` sends each step of the client's session to the server computing its span
(blocks ``[start, end)``), waits for the answer within the step deadline its server has earned
(``measurements.ServerMeasurements``), and remembers every hidden state it sent (``history``), so that a
replacement can be replayed the same inputs when this server fails (``inference_session``).

A rollback reaches the server with the next step (``start_from_position``). A server whose blocks keep a
fixed-size state (linear attention, state-space layers) can go back only to 0 or to the start of one of
its last few steps (``petals.kv_cache.states``), while speculative decoding rolls back into the middle of
its last step; such a server is rewound to the latest start it keeps, and the next step sends it the
positions from there again, from the history, in front of the new ones: no extra round trip, and its
answer for those positions is dropped. Servers of attention alone rewind anywhere and see no change.

A session opens with an ``alloc_timeout`` as long as the step deadline its server has earned: a server
with no room for it yet keeps it in its line that long rather than refusing it, and the client waits
that much longer for its first answer (an answer that took longer than the step itself may says nothing of
the server's speed, and is not measured).

A session closed with ``keep`` (servers of ours only: their records announce ``cache_pages``) stays on
its server under a key, its pages lent until it is continued; its next step reopens it (``resume``: the
position the step starts at), once the server has ended the stream it was closed on (then it is kept). The server answers how many positions it still holds; where that is less
(it lent the pages to a session that needed them, or a server kept nothing), its answer is dropped
and the next step sends it the positions from there, from the history. Without a server of ours, a
session closed with ``keep`` is sent its whole history again with its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import torch
from hivemind.proto import runtime_pb2
from transformers import PretrainedConfig

from petals.block import cache_spec
from petals.client.routing import RemoteSequenceManager, ServerMisbehaved
from petals.data_structures import RemoteSpanInfo
from petals.network.rpc import open_inference_stream
from petals.tracing import NO_TRACE, StepTrace
from petals.wire import deserialize_tensor, pack_args_kwargs, read_metadata, serialize_tensor, write_metadata

EMPTY = torch.empty(0)
EMPTY_IDS = torch.empty(0, dtype=torch.int64)
# one step's (hidden states, deep prompts or None, beam reorder ids or None)
StepTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# most steps send no prompts and no hypo_ids: their placeholders are serialized once
EMPTY_PROTO, EMPTY_IDS_PROTO = serialize_tensor(EMPTY), serialize_tensor(EMPTY_IDS)


class ServerSession:
    """One open ``rpc_inference`` stream to the server computing ``span`` (blocks ``[start, end)``)."""

    def __init__(self, manager: RemoteSequenceManager, span: RemoteSpanInfo, max_length: int) -> None:
        self.manager, self.span, self.max_length = manager, span, max_length
        self.session_id = str(uuid.uuid4())
        self._history: list[torch.Tensor] = []  # everything this server was sent, step by step
        self.position = 0
        self._start_from: int | None = None  # a rollback the server learns with the next step
        self._step_starts = StepStarts()
        self._requests: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self._responses: AsyncIterator[runtime_pb2.ExpertResponse] | None = None
        self._opening_sent = False  # the first request carries the session's parameters
        self._unanswered = 0  # answers to skip before the next step's: the empty opening step's
        self._open_error: BaseException | None = None  # from opening ahead, raised by the first step
        self._alloc_wait = 0.0  # the opening's time in the server's line, waited for with its first answer
        self.kept_as: str | None = None  # the key its server keeps it under (closed with keep)
        self._closing: asyncio.Task | None = None  # the end of the stream it was kept by, drained

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

    @staticmethod
    async def _request_stream(
        requests: asyncio.Queue[runtime_pb2.ExpertRequest | None],
    ) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (request := await requests.get()) is not None:
            yield request

    @property
    def resuming(self) -> bool:
        """Whether its next step reopens the session its server keeps (``kept_as``)."""
        return self.kept_as is not None and not self._opening_sent

    @property
    def step_start(self) -> int:
        """The position the next step's first sent position has (before a rollback's resend, if any)."""
        return self._start_from if self._start_from is not None else self.position

    async def step(
        self,
        tensors: StepTensors,
        step_id: str,
        next_servers: list[list[Any]] | None,
        trace: StepTrace = NO_TRACE,
        name: str = "server",
    ) -> torch.Tensor | None:
        """One step on this server: ``tensors`` are its ``(hidden, prompts, hypo_ids)``. None where it
        reopened a kept session of which the server holds less than the step starts after: the step is to
        be sent again (``resent_from`` then says from where)."""
        started = trace.now()
        hidden = tensors[0]
        if self.resent_from is not None:
            tensors = (torch.cat([self.history[:, self.resent_from :], hidden], dim=1), *tensors[1:])
        sent, resuming = tensors[0], self.resuming
        request = self._request(tensors, step_id, next_servers, trace.enabled)
        started = trace.add_since("client: serialization", started)
        response = await self._exchange(request, tokens=sent.shape[0] * sent.shape[1])
        started = trace.add_since(f"client: wait for {name}", started)
        if trace.enabled:
            self._record_server_trace(response, trace, name)
            started = trace.now()
        if resuming and not self._resumed(response):
            return None
        output = self._accept(response, sent, hidden.shape[1])
        trace.add_since("client: serialization", started)
        return output.to(hidden.dtype)

    @property
    def resent_from(self) -> int | None:
        """Where the next step starts if it sends the server positions again (after a rollback into the
        middle of a step the server cannot rewind into), else None. Its inputs and outputs are then longer
        than the step's, and start at position 0 if this is 0 (deep prompts go with position 0)."""
        if self._start_from is not None and self._start_from < self.position:
            return self._start_from
        return None

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
            self._alloc_wait = self._deadline(hidden.shape[0] * max(hidden.shape[1], 1))
            metadata.update(
                max_length=self.max_length,
                points=0.0,
                active_adapter=config.active_adapter,
                alloc_timeout=self._alloc_wait,
            )
            if self.kept_as is not None:  # its first step starts where the kept session is to continue
                metadata["resume"] = {"key": self.kept_as, "position": self.step_start}
        if self._start_from is not None and "resume" not in metadata:
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
        if self._closing is not None:  # its server ended the kept session before it is continued
            closing, self._closing = self._closing, None
            await closing
        await self._open_stream()
        sent, deadline = time.perf_counter(), self._deadline(tokens)
        self._requests.put_nowait(request)
        async with asyncio.timeout(deadline + self._alloc_wait):  # the opening may wait in the server's line
            while self._unanswered:  # the opening step's answer comes first: nothing to read in it
                await anext(self._responses)
                self._unanswered -= 1
            response = await anext(self._responses)
        self._alloc_wait, seconds = 0.0, time.perf_counter() - sent
        if seconds <= deadline:  # longer: it waited in the server's line, which says nothing of its speed
            self.manager.measurements.observe(self.span, tokens, seconds)
        return response

    def _deadline(self, tokens: int) -> float:
        """How long a step of ``tokens`` tokens may take here (also how long the opening may wait in the
        server's line for pages)."""
        return self.manager.measurements.deadline(self.span, tokens, self._replaceable())

    def _replaceable(self) -> bool:
        """Whether other servers that answered a ping (banned ones too: a ban ends, a new server may
        join meanwhile) cover this span's blocks: a step that hangs here may be worth moving elsewhere."""
        span, covered, pings = self.span, set(), self.manager.pings
        for other in self.manager.spans.values():
            if other.peer_id != span.peer_id and math.isfinite(pings.get(other.peer_id, math.inf)):
                covered.update(range(max(other.start, span.start), min(other.end, span.end)))
        return len(covered) == span.length

    async def _open_stream(self) -> None:
        if self._responses is None:
            self._responses = await asyncio.wait_for(
                open_inference_stream(
                    self.manager.network.p2p, self.span.peer_id, self._request_stream(self._requests)
                ),
                self.manager.config.connect_timeout,
            )

    def _resumed(self, response: runtime_pb2.ExpertResponse) -> bool:
        """Whether the server continued its kept session from where the step starts (its first answer's
        ``position``). If it holds less (none: a server that kept nothing), the next step starts from
        what it holds, and this answer is dropped (a stock server computed it at the wrong positions)."""
        asked = self.step_start
        try:
            held = read_metadata(response.metadata).get("position", 0) if response.metadata else 0
        except ValueError:
            held = None
        if type(held) is not int or not 0 <= held <= asked:
            raise ServerMisbehaved(
                f"server {self.span.peer_id} resumed a session at position {held!r}, asked for {asked}"
            )
        if held == asked:
            return True
        self._start_from = held
        self._step_starts.forget_from(held)
        return False

    def _accept(self, response: runtime_pb2.ExpertResponse, sent: torch.Tensor, new: int) -> torch.Tensor:
        """The server's output for the step's ``new`` positions, the last of ``sent``, checked; the step now
        counts as done on this server."""
        if len(response.tensors) != 1:
            raise ServerMisbehaved(
                f"server {self.span.peer_id} answered an inference step with {len(response.tensors)} tensors"
            )
        output = deserialize_tensor(response.tensors[0])
        if output.shape != sent.shape:
            raise ServerMisbehaved(
                f"server {self.span.peer_id} returned shape {list(output.shape)} for {list(sent.shape)}"
            )
        resent = sent.shape[1] - new
        self._history.append(sent[:, resent:])
        if sent.shape[1] > 0:
            self._step_starts.stepped(self.position - resent)
        self.position += new
        self._start_from = None
        return output[:, resent:]

    @staticmethod
    def _record_server_trace(response: runtime_pb2.ExpertResponse, trace: StepTrace, name: str) -> None:
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
        """Forget the positions from ``position`` on; the next step tells the server (``start_from_position``)
        where to go back to: ``position``, or, where the server cannot go there, the latest start of a step
        before it that the server keeps (the next step then sends it the positions from there again)."""
        if position < self.position:
            self._history = [self.history[:, :position]] if position else []
            self.position = position
            self._start_from = self._rewind_point(position)

    def _rewind_point(self, position: int) -> int:
        """``position`` if the server can rewind there, else the latest position before it that it keeps."""
        if self._steps_kept is None:
            return position
        return self._step_starts.rewind_point(position, self._steps_kept)

    @functools.cached_property
    def _steps_kept(self) -> int | None:
        return steps_kept(self.manager.config, self.span.start, self.span.end)

    async def close(self, keep: str | None = None) -> None:
        """End the stream politely (an empty request) without waiting for the server's end of it; with
        ``keep``, ask the server to keep the session under that key, for the next step to reopen it.

        The server frees the session's cache (or keeps it) when it reads the end of the stream; waiting
        for its answer would cost the caller a round trip per generation, so the answer is drained in the
        background (for at most a second: a dead server never answers).
        """
        if self._responses is None:
            return
        kept = keep if keep is not None and self.span.server_info.cache_pages is not None else None
        metadata = write_metadata({"keep": kept}) if kept is not None else b""
        self._requests.put_nowait(runtime_pb2.ExpertRequest(metadata=metadata))
        self._requests.put_nowait(None)
        responses, self._responses = self._responses, None
        closing = spawn(_drain_briefly(responses))
        if keep is not None:
            self._reopen_later(kept)
            self._closing = closing

    def _reopen_later(self, kept: str | None) -> None:
        """Closed to be continued: the next step opens a new stream, reopening the kept session (or, with
        nothing kept, sending the whole history again)."""
        self.kept_as, self.session_id = kept, str(uuid.uuid4())
        self._requests = asyncio.Queue()
        self._opening_sent, self._unanswered, self._open_error = False, 0, None
        if kept is None and self.position > 0:
            self._start_from = 0
            self._step_starts.forget_from(0)


class StepStarts:
    """Where a server's steps began, as far as a server of fixed-size states keeps them: it can rewind only
    to 0 and to the starts of its last few steps (it copies its state before each, ``LinearAttentionState``)."""

    def __init__(self) -> None:
        self._starts: list[int] = []

    def stepped(self, start: int) -> None:
        """The server computed a step from ``start`` (a state at 0 is zeros, not a copy it keeps)."""
        if start > 0:
            self._starts.append(start)

    def forget_from(self, position: int) -> None:
        """The server went back to ``position`` on its own (a kept session it holds less of)."""
        self._starts = [start for start in self._starts if start < position]

    def rewind_point(self, position: int, kept: int) -> int:
        """The latest position up to ``position`` that a server keeping its last ``kept`` steps can rewind
        to. Rewound there, the server forgets the steps from there on, and so does this."""
        starts = self._starts[max(0, len(self._starts) - kept) :]
        point = max((start for start in starts if start <= position), default=0)
        self._starts = [start for start in starts if start < point]
        return point


def steps_kept(config: PretrainedConfig, start: int, end: int) -> int | None:
    """How many of its last steps a server of blocks ``[start, end)`` can rewind to the start of (and to 0),
    or None if it can rewind to any position (none of its blocks keeps a fixed-size state)."""
    steps = (cache_spec(config, index).rewind_steps for index in range(start, end))
    return min((kept for kept in steps if kept is not None), default=None)


async def close_all(sessions: list[ServerSession], keep: str | None = None) -> None:
    """Close ``sessions``; with ``keep``, each server keeps its own under that key and its blocks."""
    await asyncio.gather(
        *(
            session.close(None if keep is None else f"{keep}:{session.span.start}:{session.span.end}")
            for session in sessions
        )
    )


_BACKGROUND: set[asyncio.Task] = set()


def spawn(coroutine: Awaitable) -> asyncio.Future:
    """Run ``coroutine`` in the background, referenced until it ends (the loop keeps only weak references)."""
    task = asyncio.ensure_future(coroutine)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


async def _drain_briefly(responses: AsyncIterator) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(_drain(responses), 1.0)


async def _drain(responses: AsyncIterator) -> None:
    async for _ in responses:
        pass
