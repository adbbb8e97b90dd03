"""``TransformerConnectionHandler``: the RPCs a Petals client calls on a server, as thin plumbing.

hivemind registers every ``rpc_*`` method as protocol ``"TransformerConnectionHandler.<method>"``,
the ids stock Petals clients call, so the class name is part of the wire protocol. The handler
decodes messages (``petals.wire``: bounded, nothing unpickled), hands requests to the
``ServingEngine`` (which checks and computes them), encodes its answers, streams an inference
session's steps and pushes outputs to the next server. A bad request fails alone with a
``WireError`` whose text, tagged with its kind, reaches the client.

An inference session ends when its client sends an empty request (then, if a request of it carried
``keep``, its pages stay for the client to continue: ``ServingEngine.close_session``), when its stream
ends or fails, or past its timeouts; each end is logged with what became of its pages. A client silent
for ``IDLE_SECONDS`` between steps lends its session's pages until its next step: a client stopped
without closing its connection (SIGSTOP, with its p2p daemon or without) keeps its stream open until
``--step_timeout`` (measured: libp2p noticed nothing in 2 minutes), but its pages go to whoever needs
them after ``IDLE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import AsyncIterator  # noqa: UP035 (hivemind spots streams by typing's alias)

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

import petals
from petals.constants import CHAIN_DELIMITER
from petals.data_structures import make_uids
from petals.membership import AdmissionGuard
from petals.patches import limit_inbound_message_size
from petals.server.engine import ServingEngine
from petals.server.metrics import NO_METRICS, NoMetrics
from petals.server.refusals import quiet_hivemind_refusals, reporting
from petals.server.sessions import ServerInferenceSession
from petals.server.validation import StepArgs, check_keep, check_output_compression, max_request_bytes
from petals.tracing import NO_TRACE, StepTrace, enabled_by_env, server_step_trace
from petals.wire import (
    MAX_STREAM_PART_BYTES,
    block_schemas,
    deserialize_tensors,
    read_metadata,
    read_stream,
    response_parts,
    serialize_tensor,
    write_metadata,
)
from petals.wire_errors import WireError, cut, shown

logger = logging.getLogger(__name__)

IDLE_SECONDS = 5.0  # a session whose client sends no step for this long lends its pages until its next one

# an engine method computing forward or backward: (uid chain, metadata, tensors) → future of the tensors to send
Computation = Callable[[ServingEngine, str, dict, list[torch.Tensor]], Future]


def unary_rpc(method: str, compute: Computation) -> Callable:
    """The ``rpc_*`` handler method answering one request with ``compute``."""

    async def rpc(
        self: TransformerConnectionHandler, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        async with reporting(method, context, self.metrics, self.admission):
            metadata = read_metadata(request.metadata)
            outputs = await self._within_timeout(
                compute(self.engine, request.uid, metadata, deserialize_tensors(request.tensors))
            )
            return runtime_pb2.ExpertResponse(tensors=self._serialize_outputs(outputs, metadata))

    rpc.__name__ = rpc.__qualname__ = method
    return rpc


def streamed_rpc(method: str, compute: Computation) -> Callable:
    """The ``rpc_*_stream`` handler method: the request and the answer come in parts."""

    async def rpc(
        self: TransformerConnectionHandler,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
        context: P2PContext,
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async with reporting(method, context, self.metrics, self.admission):
            uid, metadata, tensors = await read_stream(requests, self.max_request_bytes)
            outputs = await self._within_timeout(compute(self.engine, uid, metadata, tensors))
            for part in response_parts(self._serialize_outputs(outputs, metadata)):
                yield part

    rpc.__name__ = rpc.__qualname__ = method
    return rpc


class TransformerConnectionHandler(ServicerBase):
    """Serves forward, backward and inference sessions over the blocks of one ``ServingEngine``."""

    def __init__(
        self,
        engine: ServingEngine,
        p2p: P2P,
        *,
        client_mode: bool = False,
        metrics: NoMetrics = NO_METRICS,
        admission: AdmissionGuard | None = None,
    ) -> None:
        self.engine, self.p2p, self.client_mode, self.metrics = engine, p2p, client_mode, metrics
        self.admission = admission  # a private swarm's door (petals.membership); None: serve everyone
        self.limits = engine.limits
        self.tracing = enabled_by_env()  # answer requests' "trace" only when started with PETALS_TRACE
        self._background: set[asyncio.Task] = set()
        blocks = engine.blocks
        self.max_request_bytes = max_request_bytes(
            self.limits.max_batch_size, blocks.hidden_size, len(blocks)
        )
        # one message holds a whole inference step, or one part of a stream (Petals: up to 4 MiB)
        limit_inbound_message_size(self.p2p, max(self.max_request_bytes, MAX_STREAM_PART_BYTES + 2**16))
        quiet_hivemind_refusals()

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        async with reporting("rpc_info", context, self.metrics, self.admission):
            info = {"version": petals.__version__, "dht_client_mode": self.client_mode, **self.engine.info()}
            if request.uid:
                self.engine.backends(request.uid)
                info.update(block_schemas(self.engine.blocks.hidden_size, self.engine.blocks.dtype))
            return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(info))

    # each unary, or streamed in parts when its payload is over the daemon's unary cap
    rpc_forward = unary_rpc("rpc_forward", ServingEngine.forward)
    rpc_forward_stream = streamed_rpc("rpc_forward_stream", ServingEngine.forward)
    rpc_backward = unary_rpc("rpc_backward", ServingEngine.backward)
    rpc_backward_stream = streamed_rpc("rpc_backward_stream", ServingEngine.backward)

    # ---- inference ---------------------------------------------------------------------------

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async with reporting("rpc_inference", context, self.metrics, self.admission):
            first = await self._first_request(requests)
            if first is None:
                return
            metadata = read_metadata(first.metadata)
            session, args = await self.engine.open_session(
                first.uid, metadata, deserialize_tensors(first.tensors), context.remote_id.to_base58()
            )
            reader = asyncio.create_task(self._feed(requests, session.inbox))
            ending = _Ending()
            try:
                async for response in self._serve_session(session, first, metadata, args, ending):
                    yield response
            except BaseException as error:
                ending.failed(error)
                raise
            finally:
                reader.cancel()
                self.engine.close_session(session, ending.reason, ending.keep if ending.closed else None)

    async def _first_request(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest]
    ) -> runtime_pb2.ExpertRequest | None:
        try:
            return await asyncio.wait_for(anext(requests), self.limits.step_timeout)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise WireError(
                f"no inference request within --step_timeout {self.limits.step_timeout} s"
            ) from None

    async def _serve_session(
        self,
        session: ServerInferenceSession,
        request: runtime_pb2.ExpertRequest,
        metadata: dict,
        args: StepArgs,
        ending: _Ending,
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One response per step until the client sends an empty request or leaves (``ending`` says which,
        and the ``keep`` its requests asked for)."""
        deadline = time.monotonic() + self.limits.session_timeout
        self.engine.claim_step(session, metadata)
        ending.asked(metadata)
        trace = self._start_trace(metadata, 0.0)
        resumed = None if session.resumed_at is None else {"position": session.resumed_at}
        while True:
            yield await self._answer(session, request, metadata, args, trace, resumed)
            resumed = None
            while True:  # skip steps already computed, before decoding their tensors
                item = await self._next_request(session, deadline)
                if item is None:
                    ending.reason = "its client's stream ended"
                    return
                if not item[0].tensors:
                    ending.close(read_metadata(item[0].metadata) if item[0].metadata else {})
                    return
                request, arrived = item
                metadata = read_metadata(request.metadata)
                ending.asked(metadata)
                if self.engine.claim_step(session, metadata):
                    break
            trace = self._start_trace(metadata, arrived)
            args = self.engine.step_args(session, metadata, deserialize_tensors(request.tensors))

    async def _next_request(
        self, session: ServerInferenceSession, deadline: float
    ) -> tuple[runtime_pb2.ExpertRequest, float] | None:
        """The session's next request (None: its stream ended); while its client is silent, after
        ``IDLE_SECONDS``, its pages are lent (no step of it is in flight while this waits)."""
        timeout = self.limits.session_timeout
        if deadline - time.monotonic() <= 0:
            raise WireError(f"session exceeded --session_timeout {timeout} s")
        try:
            async with asyncio.timeout(min(self.limits.step_timeout, deadline - time.monotonic())):
                try:
                    async with asyncio.timeout(IDLE_SECONDS):
                        return await session.inbox.get()
                except TimeoutError:
                    self._lend(session)
                return await session.inbox.get()
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise WireError(f"session exceeded --session_timeout {timeout} s") from None
            raise WireError(f"no inference step within --step_timeout {self.limits.step_timeout} s") from None

    def _lend(self, session: ServerInferenceSession) -> None:
        pages = self.engine.lend(session)
        if pages:
            logger.info(
                "Session %s of %s silent for %.0f s: its %d pages are lent until its next step",
                shown(session.session_id),
                session.peer[-6:],
                IDLE_SECONDS,
                pages,
            )

    async def _answer(
        self,
        session: ServerInferenceSession,
        request: runtime_pb2.ExpertRequest,
        metadata: dict,
        args: StepArgs,
        trace: StepTrace,
        reply: dict | None = None,
    ) -> runtime_pb2.ExpertResponse:
        """The step's response; ``reply``: metadata it carries (a continued session's first: where it
        resumed)."""
        started = time.perf_counter()
        trace.add_since("parse + checks", trace.marks.get("dequeued", 0.0))
        output = await asyncio.wrap_future(self.engine.inference_step(session, args, metadata, trace))
        trace.add_compute_queue()
        mark = trace.now()
        output_proto = serialize_tensor(output.to(self.engine.blocks.dtype))
        mark = trace.add_since("serialization", mark)
        if metadata.get("next_servers") and not args.has_prompts:
            self._spawn(self._push(output_proto, request, metadata))
            await asyncio.sleep(
                0
            )  # the push is on the critical path, the reply only feeds the client's history
            trace.add_since("push", mark)
        self.metrics.inference_step_done(time.perf_counter() - started)
        if trace.enabled:
            trace.add_since("total in server", trace.marks["arrived"])
            reply = {**(reply or {}), "server_trace": trace.times}
        if not reply:
            return runtime_pb2.ExpertResponse(tensors=[output_proto])
        return runtime_pb2.ExpertResponse(tensors=[output_proto], metadata=write_metadata(reply))

    # ---- push --------------------------------------------------------------------------------

    async def rpc_push(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A previous server hands us the next step of one of our sessions (unknown sessions are ignored)."""
        async with reporting("rpc_push", context, self.metrics, self.admission):
            self.engine.backends(request.uid)
            metadata = read_metadata(request.metadata)
            session = self.engine.sessions.get(metadata.get("session_id"))
            if session is not None:
                session.inbox.put_nowait((request, self._arrival()))
            return runtime_pb2.ExpertResponse()

    async def _push(
        self, output: runtime_pb2.Tensor, request: runtime_pb2.ExpertRequest, metadata: dict
    ) -> None:
        peer_b58, session_id, start, end = metadata["next_servers"][0]
        forwarded = {
            **metadata,
            "session_id": session_id,
            "next_servers": metadata["next_servers"][1:],
            "pushed": True,
        }
        pushed = runtime_pb2.ExpertRequest(
            uid=CHAIN_DELIMITER.join(make_uids(self.engine.dht_prefix, start, end)),
            tensors=[output, *request.tensors[1:]],
            metadata=write_metadata(forwarded),
        )
        try:
            stub = type(self).get_stub(self.p2p, PeerID.from_base58(peer_b58))
            await stub.rpc_push(pushed, timeout=self.limits.request_timeout)
            self.engine.events["pushes_sent"] += 1
        except Exception as error:  # the client sends every step itself too: a failed push costs only latency
            self.engine.events["pushes_failed"] += 1
            logger.debug("Push to %s failed: %s", peer_b58, error)

    # ---- helpers -----------------------------------------------------------------------------

    async def _within_timeout(self, result: Future) -> list[torch.Tensor]:
        """A computation's result; past ``--request_timeout`` it is abandoned (its queued tasks dropped)."""
        return await asyncio.wait_for(asyncio.wrap_future(result), self.limits.request_timeout)

    def _serialize_outputs(self, outputs: Sequence[torch.Tensor], metadata: dict) -> list[runtime_pb2.Tensor]:
        compressions = check_output_compression(metadata.get("output_compression"), len(outputs))
        compressions = compressions or [runtime_pb2.CompressionType.NONE] * len(outputs)
        dtype = self.engine.blocks.dtype
        return [serialize_tensor(t.to(dtype), c) for t, c in zip(outputs, compressions, strict=True)]

    def _arrival(self) -> float:
        return time.perf_counter() if self.tracing else 0.0

    async def _feed(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], inbox: asyncio.Queue) -> None:
        """Move the client's next requests into the session inbox; ``None`` marks the end of the stream."""
        try:
            async for request in requests:
                inbox.put_nowait((request, self._arrival()))
        finally:
            inbox.put_nowait(None)

    def _start_trace(self, metadata: dict, arrived: float) -> StepTrace:
        """Timings of this step when the client asks for them and this server traces (``PETALS_TRACE``)."""
        return server_step_trace(arrived) if self.tracing and metadata.get("trace") else NO_TRACE

    def _spawn(self, coroutine: Awaitable) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Ending:
    """How an inference session ended, for its log line, and the ``keep`` its client asked for."""

    def __init__(self) -> None:
        self.reason, self.keep, self.closed = "ended", None, False

    def asked(self, metadata: dict) -> None:
        """A request's metadata: the last ``keep`` asked for wins."""
        if "keep" in metadata:
            self.keep = check_keep(metadata["keep"])

    def close(self, metadata: dict) -> None:
        """The client closed the session (an empty request, whose metadata may ask to keep it)."""
        self.asked(metadata)
        self.reason, self.closed = "closed by its client", True

    def failed(self, error: BaseException) -> None:
        self.reason = (
            "its client left"
            if isinstance(error, GeneratorExit | asyncio.CancelledError)
            else (f"failed: {cut(str(error), 120) or type(error).__name__}")
        )
