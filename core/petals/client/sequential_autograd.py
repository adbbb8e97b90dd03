"""Forward and backward through a chain of remote blocks, as one ``torch.autograd.Function``.

Forward routes for maximum throughput and calls ``rpc_forward`` span by span, keeping every span's
inputs. Backward walks the spans in reverse with ``rpc_backward``; when a server fails there, its
blocks are recomputed forward on another route (fresh inputs for each new span) and backward goes
on from there. Gradients flow to the inputs and to deep prompts; server weights stay frozen.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from petals.client.routing import MissingBlocksError, RemoteSequenceManager
from petals.client.rpc import call_chain
from petals.data_structures import RemoteSpanInfo
from petals.wire import pack_args_kwargs

logger = logging.getLogger(__name__)

EMPTY = torch.empty(0)
SpanInputs = list[tuple[RemoteSpanInfo, torch.Tensor]]


def _metadata(manager: RemoteSequenceManager, args_structure) -> dict:
    return {"points": 0.0, "active_adapter": manager.config.active_adapter, "args_structure": args_structure}


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
            manager.check_retries(attempt, error)
            logger.warning("Request failed (%s: %s); retrying on another route", type(error).__name__, error)
            manager.on_request_failure(span.peer_id if span is not None else None)
            await asyncio.sleep(manager.retry_delay(attempt))
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
            tensors, structure = pack_args_kwargs(hidden, _span_prompts(prompts, span))
            try:
                (output,) = await call_chain(
                    manager.network.p2p,
                    span.peer_id,
                    "rpc_forward",
                    manager.chain_uid(span.start, span.end),
                    tensors,
                    _metadata(manager, structure),
                    manager.config.request_timeout,
                )
            except Exception as error:
                raise _SpanError(span, error) from error
            if output.shape != hidden.shape:
                raise _SpanError(
                    span, ValueError(f"output shape {list(output.shape)} != {list(hidden.shape)}")
                )
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
    while stack:
        span, inputs = stack.pop()
        tensors, structure = pack_args_kwargs(inputs, grad_output, _span_prompts(prompts, span))
        try:
            grads = await call_chain(
                manager.network.p2p,
                span.peer_id,
                "rpc_backward",
                manager.chain_uid(span.start, span.end),
                tensors,
                _metadata(manager, structure),
                manager.config.request_timeout,
            )
        except Exception as error:
            logger.warning(
                "Backward on %s failed (%s); recomputing its blocks on another route", span.peer_id, error
            )
            manager.on_request_failure(span.peer_id)
            _, redone = await sequential_forward(manager, inputs, prompts, span.start, span.end)
            stack.extend(redone)
            continue
        manager.on_request_success(span.peer_id)
        grad_output = grads[0].to(inputs.dtype)
        if grad_prompts is not None and len(grads) > 1:
            grad_prompts[span.start : span.end] += grads[1].to(grad_prompts.dtype)
    return grad_output, grad_prompts


class RemoteChainFunction(torch.autograd.Function):
    """``apply(hidden, prompts, manager)``: blocks ``0..n`` of the swarm, differentiable."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, prompts: torch.Tensor, manager: RemoteSequenceManager
    ) -> torch.Tensor:
        inputs = hidden.detach().cpu()
        deep = prompts.detach().cpu().to(inputs.dtype) if prompts.numel() else None
        output, done = manager.network.run(sequential_forward(manager, inputs, deep, 0, len(manager)))
        ctx.manager, ctx.done, ctx.deep = manager, done, deep
        ctx.device, ctx.prompts_meta = hidden.device, (prompts.shape, prompts.dtype, prompts.device)
        return output.to(device=hidden.device, dtype=hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = grad_output.detach().cpu().to(ctx.done[0][1].dtype)
        grad_inputs, grad_prompts = ctx.manager.network.run(
            sequential_backward(ctx.manager, grad, ctx.done, ctx.deep)
        )
        shape, dtype, device = ctx.prompts_meta
        grad_prompts = grad_prompts.to(device=device, dtype=dtype) if grad_prompts is not None else None
        return grad_inputs.to(device=ctx.device, dtype=grad_output.dtype), grad_prompts, None
