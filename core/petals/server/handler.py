"""``TransformerConnectionHandler``: the RPCs a Petals client calls on a server.

hivemind registers every ``rpc_*`` method as protocol ``"TransformerConnectionHandler.<method>"``,
the ids stock Petals clients call, so the class name is part of the wire protocol. Every request is
checked (uids, metadata, tensor dtypes and shapes, lengths, sizes, adapters) before any compute;
a bad one fails alone with a ``WireError`` whose text reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, NamedTuple  # noqa: UP035 (hivemind spots streams by typing's alias)

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

import petals
from petals.constants import CHAIN_DELIMITER
from petals.data_structures import make_uids, parse_uid_chain
from petals.kv_cache import OutOfPagesError
from petals.patches import limit_inbound_message_size
from petals.server import metrics
from petals.server.backend import BlockBackend, HostedBlocks
from petals.server.cache_budget import AllocationFailed, CacheBudget
from petals.server.scheduler import ComputeQueue, Priority
from petals.server.sessions import DecodeStep, ServerInferenceSession, SessionRegistry, run_decode_steps
from petals.tracing import SERVER_TRACING, StepTrace
from petals.wire import (
    MAX_STREAM_PART_BYTES,
    WIRE_DTYPES,
    NotServedError,
    WireError,
    cut,
    deserialize_tensors,
    is_dummy,
    read_metadata,
    read_stream,
    response_parts,
    serialize_tensor,
    shown,
    tag_error,
    unpack_args,
    write_metadata,
)

logger = logging.getLogger(__name__)

MAX_SHORT_INFERENCE_TOKENS = 128  # steps up to this many tokens run all blocks as one compute task
PREFILL_CHUNK_TOKENS = 512  # longer steps run block by block, in chunks of this many tokens (causal: exact)


class InferenceArgs(NamedTuple):
    hidden: torch.Tensor
    prompts: list[torch.Tensor | None]
    hypo_ids: torch.Tensor | None
    request: runtime_pb2.ExpertRequest  # as received, forwarded by rpc_push


@dataclass(frozen=True)
class HandlerLimits:
    max_batch_size: int  # tokens (batch × length) per request
    inference_max_length: int
    request_timeout: float
    session_timeout: float
    step_timeout: float
    adapters: tuple[str, ...] = ()


# a handler method computing forward or backward: (handler, uid chain, metadata, tensors) → tensors to send
Computation = Callable[
    ["TransformerConnectionHandler", str, dict, list[torch.Tensor]], Awaitable[list[torch.Tensor]]
]


def unary_rpc(method: str, compute: Computation) -> Callable:
    """The ``rpc_*`` handler method answering one request with ``compute``."""

    async def rpc(
        self: TransformerConnectionHandler, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        async with self._reporting(method, context):
            metadata = read_metadata(request.metadata)
            outputs = await compute(self, request.uid, metadata, deserialize_tensors(request.tensors))
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
        async with self._reporting(method, context):
            uid, metadata, tensors = await read_stream(requests, self.max_request_bytes)
            outputs = await compute(self, uid, metadata, tensors)
            for part in response_parts(self._serialize_outputs(outputs, metadata)):
                yield part

    rpc.__name__ = rpc.__qualname__ = method
    return rpc


class TransformerConnectionHandler(ServicerBase):
    """Serves forward, backward and inference sessions over the blocks of one ``HostedBlocks``."""

    def __init__(
        self,
        blocks: HostedBlocks,
        dht_prefix: str,
        p2p: P2P,
        compute: ComputeQueue,
        budget: CacheBudget,
        sessions: SessionRegistry,
        limits: HandlerLimits,
    ) -> None:
        self.blocks, self.dht_prefix, self.p2p = blocks, dht_prefix, p2p
        self.compute, self.budget, self.sessions, self.limits = compute, budget, sessions, limits
        self._background: set[asyncio.Task] = set()
        self.max_request_bytes = max_request_bytes(
            limits.max_batch_size, blocks.hidden_size, len(blocks.backends)
        )
        # one message holds a whole inference step, or one part of a stream (Petals: up to 4 MiB)
        limit_inbound_message_size(self.p2p, max(self.max_request_bytes, MAX_STREAM_PART_BYTES + 2**16))
        logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_quiet_refusals)
        # counters, reported under the extra rpc_info key "stats" (stock Petals peers ignore it)
        self.stats = dict.fromkeys(
            (
                "inference_steps",
                "steps_from_pushes",
                "duplicate_steps_dropped",
                "pushes_sent",
                "pushes_failed",
            ),
            0,
        )

    # ---- rpc_info ----------------------------------------------------------------------------

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        async with self._reporting("rpc_info", context):
            info: dict[str, Any] = {
                "version": petals.__version__,
                "dht_client_mode": False,
                "cache_tokens_available": self.budget.tokens_left,
                "stats": {
                    **self.stats,
                    "merged_batches": self.compute.batches_merged,
                    # decode forwards by the number of sessions merged into them
                    **{
                        f"decode_batch_size_{size}": count for size, count in self.compute.batch_sizes.items()
                    },
                    # torch threads of one-token decode steps now (a fixed --decode_threads, or learned)
                    **self.compute.threads.describe((Priority.DECODE, 1)),
                },
            }
            if request.uid:
                self._backends(request.uid)
                info.update(self.blocks.schema_info())
            return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(info))

    # ---- forward / backward ------------------------------------------------------------------

    async def _forward_request(
        self, uid: str, metadata: dict, tensors: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        backends = self._with_adapter(self._backends(uid), metadata)
        args = unpack_args(tensors, metadata.get("args_structure"))
        if not args:
            raise WireError("rpc_forward expects (hidden_states, prompts)")
        hidden = self._check_hidden(args[0], allow_empty=False)
        prompts = self._check_prompts(args[1] if len(args) > 1 else None, len(backends), hidden)
        output = await asyncio.wait_for(
            self._run_forward(backends, hidden, prompts), self.limits.request_timeout
        )
        return [output]

    async def _run_forward(
        self, backends: Sequence[BlockBackend], hidden: torch.Tensor, prompts: Sequence[torch.Tensor | None]
    ) -> torch.Tensor:
        tokens = hidden.shape[0] * hidden.shape[1]
        for backend, prompt in zip(backends, prompts, strict=True):
            hidden = await self.compute.run(Priority.FORWARD, tokens, _bind(backend.forward, hidden, prompt))
        return hidden

    async def _backward_request(
        self, uid: str, metadata: dict, tensors: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        backends = self._with_adapter(self._backends(uid), metadata)
        args = unpack_args(tensors, metadata.get("args_structure"))
        if len(args) < 2:
            raise WireError("rpc_backward expects (inputs, grad_outputs, prompts)")
        hidden = self._check_hidden(args[0], allow_empty=False)
        grad_output = self._check_hidden(args[1], allow_empty=False)
        if grad_output.shape != hidden.shape:
            raise WireError(
                f"grad_outputs shape {list(grad_output.shape)} differs from inputs {list(hidden.shape)}"
            )
        prompts = self._check_prompts(args[2] if len(args) > 2 else None, len(backends), hidden)
        run = self._run_backward(backends, hidden, grad_output, prompts)
        return await asyncio.wait_for(run, self.limits.request_timeout)

    async def _run_backward(
        self,
        backends: Sequence[BlockBackend],
        hidden: torch.Tensor,
        grad_output: torch.Tensor,
        prompts: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        tokens = hidden.shape[0] * hidden.shape[1]
        inputs = [hidden]
        for backend, prompt in zip(backends[:-1], prompts[:-1], strict=True):
            inputs.append(
                await self.compute.run(Priority.FORWARD, tokens, _bind(backend.forward, inputs[-1], prompt))
            )
        grad_prompts = []
        for backend, prompt, block_input in reversed(list(zip(backends, prompts, inputs, strict=True))):
            task = _bind(backend.backward, block_input, prompt, grad_output)
            grad_output = await self.compute.run(Priority.FORWARD, tokens, task)
            if prompt is not None:
                grad_prompts.append(grad_output[:, : prompt.shape[-2]])
        if not grad_prompts:
            return [grad_output]
        return [grad_output, torch.stack(grad_prompts[::-1])]

    # each unary, or streamed in parts when its payload is over the daemon's unary cap
    rpc_forward = unary_rpc("rpc_forward", _forward_request)
    rpc_forward_stream = streamed_rpc("rpc_forward_stream", _forward_request)
    rpc_backward = unary_rpc("rpc_backward", _backward_request)
    rpc_backward_stream = streamed_rpc("rpc_backward_stream", _backward_request)

    # ---- inference ---------------------------------------------------------------------------

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async with self._reporting("rpc_inference", context):
            first = await self._first_request(requests)
            if first is None:
                return
            backends = self._backends(first.uid)
            metadata = read_metadata(first.metadata)
            backends = self._with_adapter(backends, metadata)
            max_length = metadata.get("max_length")
            if max_length is None:
                raise WireError("the first inference request must carry metadata max_length")
            if max_length > self.limits.inference_max_length:
                raise WireError(
                    f"max_length {max_length} exceeds this server's --inference_max_length "
                    f"{self.limits.inference_max_length}"
                )
            args = self._inference_args(first, metadata, metadata, len(backends))
            batch_size, first_tokens = args[0].shape[:2]
            alloc_timeout = min(metadata.get("alloc_timeout") or 0.0, self.limits.request_timeout)
            await self.budget.admit(backends, batch_size, max_length, first_tokens, alloc_timeout)
            caches = self.budget.open_caches(backends, batch_size, max_length)
            session_id = metadata.get("session_id") or str(uuid.uuid4())
            session = ServerInferenceSession(session_id, list(backends), caches, batch_size, max_length)
            try:
                with self.sessions.registered(session):
                    async for response in self._serve_session(session, args, metadata, requests):
                        yield response
            finally:  # after its queued steps, never under a forward that merged it with others
                self.compute.forget(session.session_id)
                self._spawn(self.compute.run(Priority.DECODE, 0, session.release))

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
        first_args: InferenceArgs,
        first_metadata: dict,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One response per step until the client sends an empty request or leaves."""
        reader = asyncio.create_task(_feed(requests, session.inbox))
        deadline = time.monotonic() + self.limits.session_timeout
        args, metadata = first_args, first_metadata
        self._claim_step(session, metadata)
        trace = _start_trace(metadata, 0.0)
        try:
            while True:
                yield await self._inference_step(session, args, metadata, trace)
                while True:  # skip steps already computed, before decoding their tensors
                    item = await self._next_step(session, deadline)
                    if item is None or not item[0].tensors:
                        return
                    request, arrived = item
                    metadata = read_metadata(request.metadata)
                    if self._claim_step(session, metadata):
                        break
                trace = _start_trace(metadata, arrived)
                args = self._inference_args(request, metadata, first_metadata, len(session.backends))
        finally:
            reader.cancel()

    def _claim_step(self, session: ServerInferenceSession, metadata: dict) -> bool:
        """False for a step this session already computed (a push and the client's copy race)."""
        step_id = metadata.get("step_id")
        if step_id is not None:
            if step_id in session.done_steps:
                self.stats["duplicate_steps_dropped"] += 1
                return False
            session.done_steps.add(step_id)
        return True

    async def _next_step(
        self, session: ServerInferenceSession, deadline: float
    ) -> tuple[runtime_pb2.ExpertRequest, float] | None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireError(f"session exceeded --session_timeout {self.limits.session_timeout} s")
        try:
            async with asyncio.timeout(min(self.limits.step_timeout, left)):
                return await session.inbox.get()
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise WireError(
                    f"session exceeded --session_timeout {self.limits.session_timeout} s"
                ) from None
            raise WireError(f"no inference step within --step_timeout {self.limits.step_timeout} s") from None

    async def _inference_step(
        self, session: ServerInferenceSession, args: InferenceArgs, metadata: dict, trace: StepTrace | None
    ) -> runtime_pb2.ExpertResponse:
        step_started = time.perf_counter()
        if trace is not None:
            trace.add_since("parse + checks", trace.marks["dequeued"])
        self.stats["inference_steps"] += 1
        self.stats["steps_from_pushes"] += bool(metadata.get("pushed"))
        hidden, prompts, hypo_ids, request = args
        if hidden.shape[0] != session.batch_size:
            raise WireError(
                f"this session has batch size {session.batch_size}, got hidden states of {hidden.shape[0]}"
            )
        if hypo_ids is not None:
            self._check_hypo_ids(hypo_ids, session.batch_size)
        start = metadata.get("start_from_position")
        if start is not None and start > session.position:
            raise WireError(
                f"start_from_position {start} is beyond the {session.position} tokens processed so far"
            )
        position = session.position if start is None else start
        if position + hidden.shape[1] > session.max_length:
            raise WireError(
                f"Maximum length exceeded: {position} tokens so far + {hidden.shape[1]} new > "
                f"max_length {session.max_length}"
            )
        output = await self._run_inference(session, hidden, prompts, hypo_ids, start, trace)
        started = time.perf_counter() if trace is not None else 0.0
        output_proto = serialize_tensor(output.to(self.blocks.dtype))
        if trace is not None:
            started = trace.add_since("serialization", started)
        if metadata.get("next_servers") and all(prompt is None for prompt in prompts):
            self._spawn(self._push(output_proto, request, metadata))
            await asyncio.sleep(
                0
            )  # the push is on the critical path, the reply only feeds the client's history
            if trace is not None:
                trace.add_since("push", started)
        metrics.inference_step_done(step_started)
        if trace is None:
            return runtime_pb2.ExpertResponse(tensors=[output_proto])
        trace.add_since("total in server", trace.marks["arrived"])
        return runtime_pb2.ExpertResponse(
            tensors=[output_proto], metadata=write_metadata({"server_trace": trace.times})
        )

    async def _run_inference(
        self,
        session: ServerInferenceSession,
        hidden: torch.Tensor,
        prompts: list[torch.Tensor | None],
        hypo_ids: torch.Tensor | None,
        start: int | None,
        trace: StepTrace | None = None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0] * hidden.shape[1]
        if tokens <= MAX_SHORT_INFERENCE_TOKENS and all(prompt is None for prompt in prompts):
            key = (session.span_key, hidden.shape[1], hidden.dtype)  # any positions and batch sizes merge
            step = DecodeStep(session, hidden, hypo_ids, start, trace)
            if trace is not None:
                trace.mark("queued")
            output = await self.compute.run_batched(
                Priority.DECODE, tokens, key, step, run_decode_steps, member=session.session_id
            )
            if trace is not None:
                _record_compute_queue(trace)
            if isinstance(output, Exception):  # this session's own failure (e.g. no free page)
                raise output
            return output
        if tokens <= MAX_SHORT_INFERENCE_TOKENS:
            return await self.compute.run(
                Priority.DECODE, tokens, _bind(_prepare_and_run, session, hidden, prompts, hypo_ids, start)
            )
        # a long prefill: one task per block and chunk of tokens, so that others' decode steps slip in
        await self.compute.run(Priority.DECODE, 0, _bind(session.prepare, hypo_ids, start))
        chunk_length = max(1, PREFILL_CHUNK_TOKENS // hidden.shape[0])
        for index, prompt in enumerate(prompts):
            chunks = hidden.split(chunk_length, dim=1) if prompt is None else [hidden]
            outputs = []
            for chunk in chunks:
                run_chunk = _bind(session.run_block, index, chunk, prompt)
                outputs.append(
                    await self.compute.run(Priority.PREFILL, chunk.numel() // chunk.shape[-1], run_chunk)
                )
            hidden = torch.cat(outputs, dim=1)
        return hidden.cpu()

    def _inference_args(
        self, request: runtime_pb2.ExpertRequest, metadata: dict, first_metadata: dict, num_blocks: int
    ) -> InferenceArgs:
        structure = metadata.get("args_structure", first_metadata.get("args_structure"))
        args = unpack_args(deserialize_tensors(request.tensors), structure)
        if not args:
            raise WireError("an inference step expects (hidden_states, prompts, hypo_ids)")
        hidden = self._check_hidden(args[0], allow_empty=True)
        prompts = self._check_prompts(args[1] if len(args) > 1 else None, num_blocks, hidden)
        hypo_ids = args[2] if len(args) > 2 and not is_dummy(args[2]) else None
        return InferenceArgs(hidden, prompts, hypo_ids, request)

    # ---- push --------------------------------------------------------------------------------

    async def rpc_push(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A previous server hands us the next step of one of our sessions (unknown sessions are ignored)."""
        async with self._reporting("rpc_push", context):
            self._backends(request.uid)
            metadata = read_metadata(request.metadata)
            session = self.sessions.get(metadata.get("session_id"))
            if session is not None:
                session.inbox.put_nowait((request, time.perf_counter() if SERVER_TRACING else 0.0))
            return runtime_pb2.ExpertResponse()

    async def _push(
        self, output: runtime_pb2.Tensor, request: runtime_pb2.ExpertRequest, metadata: dict
    ) -> None:
        peer_b58, session_id, start, end = metadata["next_servers"][0]
        pushed = runtime_pb2.ExpertRequest(
            uid=CHAIN_DELIMITER.join(make_uids(self.dht_prefix, start, end)),
            tensors=[output, *request.tensors[1:]],
            metadata=write_metadata(
                {
                    **metadata,
                    "session_id": session_id,
                    "next_servers": metadata["next_servers"][1:],
                    "pushed": True,
                }
            ),
        )
        try:
            stub = type(self).get_stub(self.p2p, PeerID.from_base58(peer_b58))
            await stub.rpc_push(pushed, timeout=self.limits.request_timeout)
            self.stats["pushes_sent"] += 1
        except Exception as error:  # the client sends every step itself too: a failed push costs only latency
            self.stats["pushes_failed"] += 1
            logger.debug("Push to %s failed: %s", peer_b58, error)

    # ---- checks and helpers ------------------------------------------------------------------

    def _backends(self, uid_chain: str) -> list[BlockBackend]:
        uids = parse_uid_chain(uid_chain)
        if not uids:
            raise WireError("the request names no block uids")
        missing = [uid for uid in uids if uid not in self.blocks.backends]
        if missing:
            raise NotServedError(
                f"this server does not serve {', '.join(missing[:3])}; it serves "
                f"{self.dht_prefix}.{self.blocks.start} to {self.dht_prefix}.{self.blocks.end - 1}"
            )
        return [self.blocks.backends[uid] for uid in uids]

    def _with_adapter(self, backends: list[BlockBackend], metadata: dict) -> list[BlockBackend]:
        """The blocks computing with the request's ``active_adapter`` (one this server preloaded)."""
        adapter = metadata.get("active_adapter")
        if adapter and adapter not in self.limits.adapters:
            available = ", ".join(self.limits.adapters) or "none"
            raise WireError(f"unknown adapter {shown(adapter)}; this server has: {available}")
        return [backend.with_adapter(adapter) for backend in backends]

    def _check_hidden(self, hidden: torch.Tensor, *, allow_empty: bool) -> torch.Tensor:
        if not hidden.is_floating_point():
            raise WireError(f"hidden states must be a floating-point tensor, got {hidden.dtype}")
        if hidden.ndim != 3:
            raise WireError(
                f"hidden states must have shape [batch, length, hidden], got {list(hidden.shape)}"
            )
        if hidden.shape[-1] != self.blocks.hidden_size:
            raise WireError(f"hidden size is {hidden.shape[-1]}, this model's is {self.blocks.hidden_size}")
        if hidden.shape[0] == 0 or (hidden.shape[1] == 0 and not allow_empty):
            raise WireError(f"hidden states are empty: shape {list(hidden.shape)}")
        tokens = hidden.shape[0] * hidden.shape[1]
        if tokens > self.limits.max_batch_size:
            raise WireError(
                f"the request has {tokens} tokens (batch × length), more than this server's "
                f"--max_batch_size {self.limits.max_batch_size}; split it"
            )
        return hidden

    def _check_prompts(
        self, prompts: torch.Tensor | None, num_blocks: int, hidden: torch.Tensor
    ) -> list[torch.Tensor | None]:
        if prompts is None or is_dummy(prompts):
            return [None] * num_blocks
        if not prompts.is_floating_point() or prompts.ndim != 4:
            raise WireError(
                f"deep prompts must be a float tensor [blocks, batch, pre_len, hidden], got {prompts.shape}"
            )
        blocks, batch, pre_len, hidden_size = prompts.shape
        if blocks != num_blocks or batch not in (1, hidden.shape[0]) or hidden_size != hidden.shape[-1]:
            raise WireError(
                f"deep prompts of shape {list(prompts.shape)} do not fit {num_blocks} blocks and hidden states "
                f"{list(hidden.shape)}"
            )
        if pre_len > hidden.shape[1]:
            raise WireError(
                f"deep prompts cover {pre_len} positions but the step has only {hidden.shape[1]} tokens"
            )
        return list(prompts)

    @staticmethod
    def _check_hypo_ids(hypo_ids: torch.Tensor, batch_size: int) -> None:
        if hypo_ids.dtype != torch.int64 or hypo_ids.shape != (batch_size,):
            raise WireError(
                f"hypo_ids must be int64 of shape [{batch_size}], got {hypo_ids.dtype} {list(hypo_ids.shape)}"
            )
        if hypo_ids.numel() and not (0 <= int(hypo_ids.min()) and int(hypo_ids.max()) < batch_size):
            raise WireError(f"hypo_ids must be in [0, {batch_size}), got {hypo_ids.tolist()}")

    def _serialize_outputs(self, outputs: Sequence[torch.Tensor], metadata: dict) -> list[runtime_pb2.Tensor]:
        compressions = metadata.get("output_compression") or [runtime_pb2.CompressionType.NONE] * len(outputs)
        if len(compressions) != len(outputs):
            raise WireError(f"output_compression has {len(compressions)} entries for {len(outputs)} outputs")
        return [
            serialize_tensor(t.to(self.blocks.dtype), c) for t, c in zip(outputs, compressions, strict=True)
        ]

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @asynccontextmanager
    async def _reporting(self, method: str, context: P2PContext) -> AsyncIterator[None]:
        """Log each failure once, and send it to the peer tagged with its kind (``wire.ERROR_KINDS``)."""
        metrics.request_started(method)
        try:
            yield
        except REFUSALS as error:
            metrics.request_failed(method, _kind(error))
            logger.info("%s from %s refused: %s", method, _short(context.remote_id), cut(str(error)))
            raise Refusal(tag_error(_kind(error), cut(str(error), 2000))) from None
        except Exception as error:
            metrics.request_failed(method, "internal")
            logger.exception("%s from %s failed", method, _short(context.remote_id))
            raise Refusal(tag_error("internal", cut(str(error), 2000))) from None


class Refusal(Exception):
    """What the peer receives: the error text with its kind in front."""


def _kind(error: BaseException) -> str:
    if isinstance(error, AllocationFailed | OutOfPagesError):
        return "cache_full"
    if isinstance(error, TimeoutError):
        return "timeout"
    return error.kind


def max_request_bytes(max_batch_size: int, hidden_size: int, num_blocks: int) -> int:
    """The largest request the limits allow: hidden states, their gradients and deep prompts for every
    block, at most ``max_batch_size`` tokens each, in the widest wire dtype, plus room for metadata."""
    widest = max(dtype.itemsize for dtype in WIRE_DTYPES.values())
    return max_batch_size * hidden_size * widest * (2 + num_blocks) + 2**16


REFUSALS = (WireError, AllocationFailed, OutOfPagesError, TimeoutError)
QUIET = (*REFUSALS, Refusal)


def _quiet_refusals(record: logging.LogRecord) -> bool:
    """hivemind logs every exception of a stream handler as a WARN traceback; refusals are a peer's
    mistake, already logged once (by ``_reporting`` or ``limit_inbound_message_size``), so drop those records."""
    return not (record.exc_info and isinstance(record.exc_info[1], QUIET))


def _short(peer_id: PeerID) -> str:
    return str(peer_id)[-6:]


def _bind(function, *args):
    return lambda: function(*args)


async def _feed(requests: AsyncIterator[runtime_pb2.ExpertRequest], inbox: asyncio.Queue) -> None:
    """Move the client's next requests into the session inbox; ``None`` marks the end of the stream."""
    try:
        async for request in requests:
            inbox.put_nowait((request, time.perf_counter() if SERVER_TRACING else 0.0))
    finally:
        inbox.put_nowait(None)


def _start_trace(metadata: dict, arrived: float) -> StepTrace | None:
    """Timings of this step when the client asks for them and this server traces (``PETALS_TRACE``)."""
    if not (SERVER_TRACING and metadata.get("trace")):
        return None
    trace = StepTrace()
    dequeued = trace.mark("dequeued")
    trace.marks["arrived"] = arrived or dequeued
    trace.add("arrival to dequeue", dequeued - trace.marks["arrived"])
    return trace


def _record_compute_queue(trace: StepTrace) -> None:
    """Queue wait before the compute thread took the step, and its hand-back to the event loop."""
    resumed = time.perf_counter()
    marks = trace.marks
    if "compute started" in marks:
        trace.add("queue wait", marks["compute started"] - marks["queued"])
        trace.add("hand-back to event loop", resumed - marks["compute ended"])


def _prepare_and_run(
    session: ServerInferenceSession,
    hidden: torch.Tensor,
    prompts: list[torch.Tensor | None],
    hypo_ids: torch.Tensor | None,
    start: int | None,
) -> torch.Tensor:
    session.prepare(hypo_ids, start)
    return session.run_blocks(hidden, prompts)
