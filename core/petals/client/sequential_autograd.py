"""Forward and backward through a chain of remote blocks, as one ``torch.autograd.Function``.

Forward routes for maximum throughput and calls ``rpc_forward`` span by span, keeping every span's
inputs. Backward walks the spans in reverse with ``rpc_backward``; when a server fails there, its
blocks are recomputed forward on another route (fresh inputs for each new span) and backward goes
on from there. Gradients flow to the inputs and to deep prompts; server weights stay frozen.
Large batches go as concurrent sub-batches of at most ``MAX_TOKENS_IN_BATCH`` tokens (as in Petals).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from petals.client.routing import MissingBlocksError, RemoteSequenceManager, ServerMisbehaved
from petals.data_structures import RemoteSpanInfo
from petals.network.rpc import call_chain
from petals.wire import pack_args_kwargs

logger = logging.getLogger(__name__)

EMPTY = torch.empty(0)
MAX_TOKENS_IN_BATCH = 1024  # Petals' sub-batch size, below every default --max_batch_size
SpanInputs = list[tuple[RemoteSpanInfo, torch.Tensor]]


async def _call_span(
    manager: RemoteSequenceManager, method: str, span: RemoteSpanInfo, *args: torch.Tensor
) -> list[torch.Tensor]:
    """``method`` (``rpc_forward`` / ``rpc_backward``) with ``args`` on the server of ``span``, as one chain."""
    tensors, structure = pack_args_kwargs(*args)
    metadata = {"points": 0.0, "active_adapter": manager.config.active_adapter, "args_structure": structure}
    uid = manager.chain_uid(span.start, span.end)
    return await call_chain(
        manager.network.p2p, span.peer_id, method, uid, tensors, metadata, manager.config.request_timeout
    )


def _span_prompts(prompts: torch.Tensor | None, span: RemoteSpanInfo) -> torch.Tensor:
    return EMPTY if prompts is None else prompts[span.start : span.end]


async def _with_retries(manager: RemoteSequenceManager, attempt_call):
    attempt = 0
    while True:
        try:
            return await attempt_call()
        except MissingBlocksError:
            raise
        except Exception as error:
            span = getattr(error, "span", None)
            cause = error.__cause__ if isinstance(error, _SpanError) else error
            await manager.handle_failure(cause, span.peer_id if span is not None else None, attempt)
            logger.warning("Request failed (%s: %s); retrying on another route", type(error).__name__, error)
            attempt += 1


class _SpanError(RuntimeError):
    def __init__(self, span: RemoteSpanInfo, error: BaseException) -> None:
        super().__init__(
            f"server {span.peer_id} (blocks {span.start}:{span.end}): {type(error).__name__}: {error}"
        )
        self.span = span


async def sequential_forward(
    manager: RemoteSequenceManager, hidden: torch.Tensor, prompts: torch.Tensor | None, start: int, end: int
) -> tuple[torch.Tensor, SpanInputs]:
    """Outputs of blocks ``[start, end)`` and, for every span used, the span and its inputs."""
    done: SpanInputs = []
    block = start
    while block < end:

        async def attempt(block: int = block, hidden: torch.Tensor = hidden):
            route = await manager.make_sequence(block, end, mode="max_throughput")
            span = route[0]
            sent = time.perf_counter()
            try:
                (output,) = await _call_span(
                    manager, "rpc_forward", span, hidden, _span_prompts(prompts, span)
                )
            except Exception as error:
                raise _SpanError(span, error) from error
            if output.shape != hidden.shape:
                misbehaved = ServerMisbehaved(f"output shape {list(output.shape)} != {list(hidden.shape)}")
                raise _SpanError(span, misbehaved) from misbehaved
            tokens = hidden.shape[0] * hidden.shape[1]
            manager.measurements.observe(span, tokens, time.perf_counter() - sent, inference=False)
            return span, output.to(hidden.dtype)

        span, output = await _with_retries(manager, attempt)
        done.append((span, hidden))
        hidden, block = output, span.end
    return hidden, done


async def sequential_backward(
    manager: RemoteSequenceManager,
    grad_output: torch.Tensor,
    done: SpanInputs,
    prompts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients w.r.t. the chain's inputs and (if given) the deep prompts ``[blocks, batch, pre, hidden]``."""
    grad_prompts = torch.zeros_like(prompts) if prompts is not None else None
    stack = list(done)
    failures = 0
    while stack:
        span, inputs = stack.pop()
        try:
            grads = await _call_span(
                manager, "rpc_backward", span, inputs, grad_output, _span_prompts(prompts, span)
            )
        except Exception as error:
            await manager.handle_failure(error, span.peer_id, failures)
            failures += 1
            logger.warning(
                "Backward on %s failed (%s); recomputing its blocks on another route", span.peer_id, error
            )
            _, redone = await sequential_forward(manager, inputs, prompts, span.start, span.end)
            stack.extend(redone)
            continue
        manager.on_request_success(span.peer_id)
        grad_output = grads[0].to(inputs.dtype)
        if grad_prompts is not None and len(grads) > 1:
            grad = grads[1].to(grad_prompts.dtype)  # per row; prompts shared by all rows get their sum
            if grad_prompts.shape[1] == 1:
                grad = grad.sum(dim=1, keepdim=True)
            grad_prompts[span.start : span.end] += grad
    return grad_output, grad_prompts


class RemoteChainFunction(torch.autograd.Function):
    """``apply(hidden, prompts, manager)``: blocks ``0..n`` of the swarm, differentiable.

    The batch travels in sub-batches of ``max(MAX_TOKENS_IN_BATCH // length, 1)`` rows, all in
    flight at once, so that no request exceeds a server's ``--max_batch_size`` by batch size alone.
    """

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, prompts: torch.Tensor, manager: RemoteSequenceManager
    ) -> torch.Tensor:
        inputs = hidden.detach().cpu()
        deep = prompts.detach().cpu().to(inputs.dtype) if prompts.numel() else None
        parts = sub_batches(inputs.shape[0], inputs.shape[1])
        results = manager.network.run(
            _gather(
                sequential_forward(manager, inputs[part], _prompt_rows(deep, part), 0, len(manager))
                for part in parts
            )
        )
        ctx.manager, ctx.parts, ctx.deep = manager, parts, deep
        ctx.done = [done for _, done in results]
        ctx.device, ctx.dtype = hidden.device, inputs.dtype
        ctx.prompts_meta = (prompts.dtype, prompts.device)
        output = torch.cat([output for output, _ in results])
        return output.to(device=hidden.device, dtype=hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = grad_output.detach().cpu().to(ctx.dtype)
        results = ctx.manager.network.run(
            _gather(
                sequential_backward(ctx.manager, grad[part], done, _prompt_rows(ctx.deep, part))
                for part, done in zip(ctx.parts, ctx.done, strict=True)
            )
        )
        grad_inputs = torch.cat([grad_inputs for grad_inputs, _ in results])
        grad_prompts = None
        if ctx.deep is not None:
            parts = [grad_prompts for _, grad_prompts in results]
            grad_prompts = sum(parts) if ctx.deep.shape[1] == 1 else torch.cat(parts, dim=1)
            dtype, device = ctx.prompts_meta
            grad_prompts = grad_prompts.to(device=device, dtype=dtype)
        return grad_inputs.to(device=ctx.device, dtype=grad_output.dtype), grad_prompts, None


def sub_batches(batch_size: int, length: int) -> list[slice]:
    """Petals' split: ``max(MAX_TOKENS_IN_BATCH // length, 1)`` rows per sub-batch."""
    rows = max(MAX_TOKENS_IN_BATCH // max(length, 1), 1)
    return [slice(start, min(start + rows, batch_size)) for start in range(0, batch_size, rows)]


def _prompt_rows(prompts: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """Deep prompts ``[blocks, batch|1, pre_len, hidden]`` for some rows of the batch."""
    if prompts is None or prompts.shape[1] == 1:
        return prompts
    return prompts[:, rows]


async def _gather(coroutines):
    return await asyncio.gather(*coroutines)
