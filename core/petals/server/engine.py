"""The server's serving logic without transport: sessions, KV-cache pages, step checks and batching.

``ServingEngine`` takes requests as decoded tensors and metadata and answers with tensors; it knows
nothing of hivemind, protobufs or streams. Its two halves meet in one queue:

* requests, from the handler on the event loop's thread: ``forward``, ``backward``,
  ``open_session`` / ``inference_step`` / ``close_session`` check the request (``validation``) and
  submit a *job*: a generator that yields the tasks of one request in order (a decode step is one
  task for all blocks of its span; a forward pass one task per block; a long prefill one task per
  block and chunk of tokens) and returns the request's result. They return a
  ``concurrent.futures.Future`` of that result (cancel it and the job's remaining tasks are dropped).
* compute, on one thread (``ComputeThread``): ``schedule(now)`` asks the batch policy
  (``scheduler.Scheduler``) which queued tasks run next; ``step(batch)`` runs them with torch and hands
  each job its task's result, which queues the job's next task or settles its future.

A session's pages are counted on its lease (``petals.kv_cache.lending``): a session whose client went
silent lends them (``lend``), one that ends may be kept for its client (``close_session(keep=...)``) and
continued by a later session of that client (the first request's ``resume``), and a step that needs
pages takes idle and kept ones, then preempts the most recently admitted session.

Tests drive both halves by hand on a fake clock (``tests/test_server_engine.py``); a server runs one
``ComputeThread`` per engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from petals.block import closed_boundaries
from petals.kv_cache import SessionPreempted, check_span, furthest_common
from petals.server.backend import BlockBackend, BlockGraph, HostedBlocks, backward_span
from petals.server.cache_budget import CacheBudget
from petals.server.metrics import NO_METRICS, ServerMetrics
from petals.server.scheduler import Batch, Priority, Scheduler, Task, call, task_kind
from petals.server.sessions import DecodeStep, ServerInferenceSession, SessionRegistry, run_decode_steps
from petals.server.settings import BACKWARD_GRAPH_BYTES
from petals.server.validation import (
    Limits,
    Resume,
    StepArgs,
    backward_args,
    blocks_named,
    check_adapter,
    check_hypo_ids,
    check_max_length,
    check_resume,
    check_step_position,
    forward_args,
    inference_args,
)
from petals.tracing import NO_TRACE, StepTrace
from petals.wire_errors import WireError

MAX_SHORT_INFERENCE_TOKENS = 128  # steps up to this many tokens run all blocks as one compute task
KEEPING_SECONDS = 5.0  # how long a session continuing a kept one waits for it to be kept, at most
PREFILL_CHUNK_TOKENS = 512  # longer steps run in chunks of this many tokens, each through every block

# what a job yields (a task to run) and, in the end, returns (the request's result)
Job = Generator[Task, Any, Any]
# counters reported under rpc_info's "stats" (stock Petals peers ignore that key)
EVENTS = (
    "inference_steps",
    "steps_from_pushes",
    "duplicate_steps_dropped",
    "pushes_sent",
    "pushes_failed",
    "sessions_resumed",
)


class _Request:
    """A submitted job and the future of its result."""

    __slots__ = ("future", "job")

    def __init__(self, job: Job) -> None:
        self.job, self.future = job, Future()

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        with contextlib.suppress(InvalidStateError):  # cancelled by the requester meanwhile
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)


class ServingEngine:
    """The blocks of one span, their sessions and KV-cache budget, and the queue of their compute."""

    def __init__(
        self,
        blocks: HostedBlocks,
        budget: CacheBudget,
        limits: Limits,
        scheduler: Scheduler,
        *,
        dht_prefix: str,
        metrics: ServerMetrics = NO_METRICS,
        clock: Callable[[], float] = time.perf_counter,
        backward_graph_bytes: int = BACKWARD_GRAPH_BYTES,
    ) -> None:
        self.graphs = GraphBudget(backward_graph_bytes)  # shared by all backward requests
        self.blocks, self.budget, self.limits, self.scheduler = blocks, budget, limits, scheduler
        self.dht_prefix, self.metrics, self.clock = dht_prefix, metrics, clock
        self.sessions = SessionRegistry()
        self._keeping: dict[tuple[str, str], Future] = {}  # sessions closed with keep, not kept yet
        self.events: collections.Counter[str] = collections.Counter(dict.fromkeys(EVENTS, 0))
        self.tokens_processed = 0  # token-blocks: a token through one block counts once
        self.busy_seconds = 0.0
        self.changed = threading.Condition()  # guards the scheduler; notified on every submission
        self.closed = closed_boundaries(blocks.config)  # where a request's span may not begin or end

    # ---- requests ------------------------------------------------------------------------------

    def backends(self, uid_chain: str, metadata: dict | None = None) -> list[BlockBackend]:
        """The hosted blocks a request names, computing with its ``active_adapter``."""
        description = f"{self.dht_prefix}.{self.blocks.start} to {self.dht_prefix}.{self.blocks.end - 1}"
        backends = blocks_named(uid_chain, self.blocks.backends, description)
        try:  # layers that share keys and values run in one pass, from the first to the last of them
            check_span(self.closed, backends[0].index, backends[-1].index + 1)
        except ValueError as error:
            raise WireError(f"{error}; ask for a span of this server's blocks that holds them all") from None
        if metadata is None:
            return backends
        adapter = check_adapter(metadata.get("active_adapter"), self.limits.adapters)
        return [backend.with_adapter(adapter) for backend in backends]

    def forward(self, uid_chain: str, metadata: dict, tensors: list[torch.Tensor]) -> Future:
        """The span's output for ``(hidden_states, prompts)``."""
        backends = self.backends(uid_chain, metadata)
        args = forward_args(tensors, metadata.get("args_structure"), len(backends), *self._sizes)
        return self._submit(_forward_job(backends, args))

    def backward(self, uid_chain: str, metadata: dict, tensors: list[torch.Tensor]) -> Future:
        """Gradients w.r.t. the inputs (and the deep prompts, if any) for ``(inputs, grad_outputs, prompts)``."""
        backends = self.backends(uid_chain, metadata)
        args, grad = backward_args(tensors, metadata.get("args_structure"), len(backends), *self._sizes)
        if any(backend.cache_spec.reads_from is not None for backend in backends):
            # a block's own backward would miss the gradient that flows through the keys and values a
            # later block reuses: the span runs as one graph
            return self._submit(_span_backward_job(backends, args, grad))
        return self._submit(_backward_job(backends, args, grad, self.graphs))

    async def open_session(
        self, uid_chain: str, metadata: dict, tensors: list[torch.Tensor], peer: str = ""
    ) -> tuple[ServerInferenceSession, StepArgs]:
        """Admit a session (its first request's checks, KV-cache pages) and return it with its first step.
        ``peer``: the client's peer id, whose kept sessions its ``resume`` may continue."""
        backends = self.backends(uid_chain, metadata)
        max_length = check_max_length(metadata, self.limits.inference_max_length)
        resume = check_resume(metadata.get("resume"), max_length)
        structure = metadata.get("args_structure")
        args = self._inference_args(tensors, structure, len(backends))
        session_id = metadata.get("session_id") or str(uuid.uuid4())
        self.sessions.check_new(session_id)
        batch_size = args.hidden.shape[0]
        span = (tuple((backend.uid, backend.adapter) for backend in backends), batch_size)
        if resume is not None:
            await self._kept_by_now(peer, resume.key)
        session = self._resumed(session_id, backends, max_length, span, peer, resume)
        if session is None:
            alloc_timeout = min(metadata.get("alloc_timeout") or 0.0, self.limits.request_timeout)
            if resume is not None and resume.position > 0:  # nothing kept: the client sends from 0
                args = args.empty()
            first_tokens = args.hidden.shape[1]
            lease = await self.budget.admit(
                backends, batch_size, max_length, first_tokens, alloc_timeout, span
            )
            caches = self.budget.open_caches(backends, batch_size, max_length, lease)
            session = ServerInferenceSession(
                session_id, backends, caches, batch_size, max_length, lease=lease, peer=peer
            )
            session.resumed_at = None if resume is None else 0
        elif session.resumed_at < resume.position:  # it holds fewer tokens than the step starts after
            args = args.empty()
        session.args_structure = structure
        try:
            self.sessions.add(session)  # another request may have opened the id while we waited for pages
        except WireError:
            session.end("refused")
            raise
        return session, args

    async def _kept_by_now(self, peer: str, key: str) -> None:
        """Wait (briefly) until the session the client closed with ``key`` is kept: its close and the
        session continuing it come on different streams, and keeping it waits for the compute thread."""
        ending = self._keeping.get((peer, key))
        if ending is not None:
            await asyncio.wait({asyncio.wrap_future(ending)}, timeout=KEEPING_SECONDS)

    def _resumed(
        self,
        session_id: str,
        backends: list[BlockBackend],
        max_length: int,
        span: tuple,
        peer: str,
        resume: Resume | None,
    ) -> ServerInferenceSession | None:
        """The session that continues the client's kept one ``resume`` names, if it is still kept here: at
        the furthest position up to ``resume.position`` all its blocks can rewind to (its first step
        rewinds there)."""
        lease = None if resume is None else self.budget.lender.resume((peer, resume.key), span)
        if lease is None:
            return None
        self.events["sessions_resumed"] += 1
        for cache in lease.caches:
            cache.max_length = max_length
        position = furthest_common(lease.caches, resume.position)
        session = ServerInferenceSession(
            session_id, backends, lease.caches, span[1], max_length, lease=lease, peer=peer
        )
        session.resumed_at = session.first_start = position
        return session

    def step_args(
        self, session: ServerInferenceSession, metadata: dict, tensors: list[torch.Tensor]
    ) -> StepArgs:
        """A later step's tensors (laid out as its own ``args_structure``, else the session's first one)."""
        structure = metadata.get("args_structure", session.args_structure)
        return self._inference_args(tensors, structure, len(session.backends))

    def claim_step(self, session: ServerInferenceSession, metadata: dict) -> bool:
        """False for a step this session already computed (a push and the client's copy race)."""
        if session.claim(metadata.get("step_id")):
            return True
        self.events["duplicate_steps_dropped"] += 1
        return False

    def inference_step(
        self, session: ServerInferenceSession, args: StepArgs, metadata: dict, trace: StepTrace = NO_TRACE
    ) -> Future:
        """The span's output for one step of ``session`` (rewound to ``start_from_position`` if given)."""
        self.events["inference_steps"] += 1
        self.events["steps_from_pushes"] += bool(metadata.get("pushed"))
        if session.preempted:  # its positions are gone: say so, not that the step does not fit them
            raise SessionPreempted(session.lease.preemption)
        hidden = args.hidden
        if hidden.shape[0] != session.batch_size:
            raise WireError(
                f"this session has batch size {session.batch_size}, got hidden states of {hidden.shape[0]}"
            )
        if args.hypo_ids is not None:
            check_hypo_ids(args.hypo_ids, session.batch_size)
        start = metadata.get("start_from_position")
        if session.first_start is not None:  # a continued session's first step starts where it resumed
            start, session.first_start = session.first_start, None
        check_step_position(session.position, start, hidden.shape[1], session.max_length)
        return self._submit(_inference_job(session, args, start, trace))

    def lend(self, session: ServerInferenceSession) -> int:
        """The session's client has been silent a while (no step in flight): lend its pages until its
        next step. Returns how many pages."""
        return session.lend()

    def close_session(
        self, session: ServerInferenceSession, reason: str = "closed", keep: str | None = None
    ) -> None:
        """Forget the session; after its queued steps (never under a merged forward) its pages go back, or
        stay for its client under ``keep`` (``reason``: why it ended, for the log)."""
        self.sessions.remove(session)
        with self.changed:
            self.scheduler.forget(session.session_id)
        ending = self._submit(_end_job(session, reason, keep))
        if keep is not None:  # a session continuing it waits for this (``_kept_by_now``)
            key = (session.peer, keep)
            self._keeping[key] = ending
            ending.add_done_callback(
                lambda done: self._keeping.pop(key, None) if self._keeping.get(key) is done else None
            )

    def info(self) -> dict[str, Any]:
        """What ``rpc_info`` reports about this server's state and counters."""
        scheduler, budget = self.scheduler, self.budget
        return {
            "cache_tokens_available": budget.tokens_left,
            "cache_pages": budget.page_counts(),
            "cache_queue": budget.queue(),
            "stats": {
                **self.events,
                "sessions_preempted": budget.lender.preemptions,
                "sessions_reclaimed": budget.lender.reclaimed,
                "sessions_kept": budget.lender.kept,
                "merged_batches": scheduler.batches_merged,
                # decode forwards by the number of sessions merged into them
                **{f"decode_batch_size_{size}": count for size, count in scheduler.batch_sizes.items()},
                # torch threads of one-token decode steps now (a fixed --decode_threads, or learned)
                **scheduler.threads.describe(task_kind(Priority.DECODE, "", 1)),
            },
        }

    @property
    def _sizes(self) -> tuple[int, int]:
        """(hidden size, most tokens per request): what every request's hidden states are checked against."""
        return self.blocks.hidden_size, self.limits.max_batch_size

    def _inference_args(self, tensors: list[torch.Tensor], structure: Any, num_blocks: int) -> StepArgs:
        return inference_args(tensors, structure, num_blocks, *self._sizes)

    # ---- the queue -----------------------------------------------------------------------------

    def _submit(self, job: Job) -> Future:
        request = _Request(job)
        self._advance(request, None)
        return request.future

    def _advance(self, request: _Request, result: Any) -> None:
        """Hand ``request``'s job its last task's result (an exception is raised in it); queue its next task."""
        try:
            if isinstance(result, BaseException):
                task = request.job.throw(result)
            else:
                task = request.job.send(result)
        except StopIteration as done:
            request.settle(done.value)
            return
        except BaseException as error:  # the job's own failure, or its task's that it did not handle
            request.settle(error=error)
            return
        task.owner = request
        with self.changed:
            self.scheduler.push(task, self.clock())
            self.changed.notify()

    # ---- compute (the compute thread) ----------------------------------------------------------

    def schedule(self, now: float) -> Batch | float | None:
        """The batch to run now, else seconds until one may be ready, or None when nothing is queued."""
        with self.changed:
            abandoned = self.scheduler.drop(lambda task: task.owner.future.cancelled())
            decision = self.scheduler.next_batch(now)
        for task in abandoned:  # their requesters are gone: the jobs end here
            task.owner.job.close()
        return decision

    def step(self, batch: Batch) -> None:
        """Run ``batch`` (one call for all its tasks) and advance each task's job with its result."""
        tasks = batch.tasks
        self.metrics.compute_batch_started(self.clock(), [task.submitted for task in tasks])
        torch.set_num_threads(batch.threads)  # this thread's OpenMP team: per compute thread
        started = self.clock()
        try:
            results = tasks[0].run([task.item for task in tasks])
        except BaseException as error:  # each requester reports it
            results = [error] * len(tasks)
        seconds = self.clock() - started
        with self.changed:
            self.scheduler.finished(batch, seconds)
        self.busy_seconds += seconds
        self.tokens_processed += batch.token_blocks
        for task, result in zip(tasks, results, strict=True):
            self._advance(task.owner, result)


class ComputeThread:
    """The thread that runs an engine's compute: waits for work, runs each batch the policy picks."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="petals-compute", daemon=True)

    def start(self) -> ComputeThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30) -> None:
        with self.engine.changed:
            self._stopping = True
            self.engine.changed.notify()
        self._thread.join(timeout)

    def _work(self) -> None:
        engine = self.engine
        while (batch := self._next_batch()) is not None:
            engine.step(batch)

    def _next_batch(self) -> Batch | None:
        engine = self.engine
        with engine.changed:
            while not self._stopping:
                decision = engine.schedule(engine.clock())
                if isinstance(decision, Batch):
                    return decision
                engine.changed.wait(decision)  # a merge window's rest, or (None) until work arrives
        return None


# ---- jobs: the tasks of one request, in order ---------------------------------------------------


def _forward_job(backends: Sequence[BlockBackend], args: StepArgs) -> Job:
    hidden, tokens, shared = args.hidden, args.tokens, {}  # shared: see BlockBackend.forward
    for backend, prompt in zip(backends, args.prompts, strict=True):
        hidden = yield call(Priority.FORWARD, tokens, _bind(backend.forward, hidden, prompt, shared))
    return [hidden]


class GraphBudget:
    """Activation bytes that backward requests keep between their forward and backward passes, all together."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def fits(self, nbytes: int) -> bool:
        """Whether a graph of ``nbytes`` fits; 0 means not known yet (a request's first block): then
        whether any room is left, so that a budget of 0 keeps no graph at all."""
        with self._lock:
            return self.used + nbytes <= self.limit if nbytes else self.used < self.limit

    def hold(self, nbytes: int) -> None:
        with self._lock:
            self.used += nbytes


def _backward_job(
    backends: Sequence[BlockBackend], args: StepArgs, grad_output: torch.Tensor, graphs: GraphBudget
) -> Job:
    """Each block forward once, keeping its autograd graph while ``graphs`` has room, then backward
    block by block; a block whose graph was not kept is recomputed in its backward task."""
    tokens, last = args.tokens, len(backends) - 1
    hidden, steps, kept, estimate = args.hidden, [], 0, 0  # estimate: one block's graph, the first's
    try:
        for index, (backend, prompt) in enumerate(zip(backends, args.prompts, strict=True)):
            graph = None
            if graphs.fits(estimate):
                graph = yield call(
                    Priority.FORWARD,
                    tokens,
                    _bind(backend.forward_with_graph, hidden, prompt),
                    "forward+graph",
                )
                graphs.hold(graph.saved_bytes)
                kept, estimate = kept + graph.saved_bytes, estimate or graph.saved_bytes
            steps.append((backend, hidden, graph))
            if graph is not None:
                hidden = graph.output.detach()
            elif index < last:
                hidden = yield call(Priority.FORWARD, tokens, _bind(backend.forward, hidden, prompt))
        return (yield from _backward_pass(steps, args.prompts, grad_output, tokens))
    finally:
        graphs.hold(-kept)


def _span_backward_job(backends: Sequence[BlockBackend], args: StepArgs, grad_output: torch.Tensor) -> Job:
    """The span forward as one autograd graph, then its backward, in one task: for spans where later
    blocks reuse the keys and values of earlier ones (``backward_span``)."""
    run = _bind(backward_span, backends, args.hidden, args.prompts, grad_output)
    grad_input, grad_prompts = yield call(Priority.FORWARD, args.tokens, run, "forward+backward")
    return [grad_input] if grad_prompts is None else [grad_input, grad_prompts]


def _backward_pass(
    steps: list[tuple[BlockBackend, torch.Tensor, BlockGraph | None]],
    prompts: list[torch.Tensor | None],
    grad_output: torch.Tensor,
    tokens: int,
) -> Job:
    grad_prompts = []
    for (backend, block_input, graph), prompt in reversed(list(zip(steps, prompts, strict=True))):
        if graph is not None:
            run, work = _bind(backend.backward_graph, graph, grad_output), "backward"
        else:
            run, work = _bind(backend.backward, block_input, prompt, grad_output), "forward+backward"
        grad_output = yield call(Priority.FORWARD, tokens, run, work)
        if prompt is not None:
            grad_prompts.append(grad_output[:, : prompt.shape[-2]])
    if not grad_prompts:
        return [grad_output]
    return [grad_output, torch.stack(grad_prompts[::-1])]


def _inference_job(
    session: ServerInferenceSession, args: StepArgs, start: int | None, trace: StepTrace
) -> Job:
    hidden, hypo_ids, tokens = args.hidden, args.hypo_ids, args.tokens
    if tokens <= MAX_SHORT_INFERENCE_TOKENS and not args.has_prompts:
        key = (session.span_key, hidden.shape[1], hidden.dtype)  # any positions and batch sizes merge
        trace.mark("queued")
        step = DecodeStep(session, hidden, hypo_ids, start, trace)
        return (
            yield Task(
                Priority.DECODE,
                tokens,
                run_decode_steps,
                item=step,
                key=key,
                member=session.session_id,
                blocks=len(session.backends),
            )
        )
    if tokens <= MAX_SHORT_INFERENCE_TOKENS:
        run = _bind(_prepare_and_run, session, args, start)
        return (yield call(Priority.DECODE, tokens, run, blocks=len(session.backends)))
    # a long prefill: one task per chunk of tokens and block, so that others' decode steps slip in. A
    # chunk goes through every block before the next one starts: layers that reuse keys and values of
    # earlier ones see those of their own chunk (``shared``, one per chunk). Deep prompts add to the first
    # positions of every block's input, so a step with them is one chunk
    yield call(Priority.DECODE, 0, _bind(session.prepare, hypo_ids, start))
    chunk_length = max(1, PREFILL_CHUNK_TOKENS // hidden.shape[0])
    chunks = [hidden] if args.has_prompts else hidden.split(chunk_length, dim=1)
    outputs = []
    for chunk in chunks:
        shared, tokens = {}, chunk.numel() // chunk.shape[-1]
        for index, prompt in enumerate(args.prompts):
            chunk = yield call(
                Priority.PREFILL, tokens, _bind(session.run_block, index, chunk, prompt, shared)
            )
        outputs.append(chunk)
    return torch.cat(outputs, dim=1).cpu()


def _end_job(session: ServerInferenceSession, reason: str, keep: str | None) -> Job:
    yield call(Priority.DECODE, 0, _bind(session.end, reason, keep))


def _prepare_and_run(session: ServerInferenceSession, args: StepArgs, start: int | None) -> torch.Tensor:
    session.prepare(args.hypo_ids, start)
    return session.run_blocks(args.hidden, args.prompts)


def _bind(function: Callable, *args: Any) -> Callable[[], Any]:
    return lambda: function(*args)
