"""Checks of a request's contents before any compute: pure functions of the request and the limits.

Each raises ``WireError`` (or ``NotServedError``) with a text that tells the peer what was wrong;
the handler sends it back tagged with its kind. Nothing here touches the network or the blocks'
state, so every rule is tested without a swarm (``tests/test_server_validation.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from petals.data_structures import parse_uid_chain
from petals.kv_cache import check_hypo_ids as _check_reorder
from petals.wire import WIRE_DTYPES, is_dummy, unpack_args
from petals.wire_errors import NotServedError, WireError, shown

B = TypeVar("B")


@dataclass(frozen=True)
class Limits:
    """What a server accepts (its ``petals serve`` options)."""

    max_batch_size: int  # tokens (batch × length) per request
    inference_max_length: int
    request_timeout: float
    session_timeout: float
    step_timeout: float
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepArgs:
    """The tensors of one request, checked: hidden states, one deep prompt (or None) per block, beam ids."""

    hidden: torch.Tensor
    prompts: list[torch.Tensor | None]
    hypo_ids: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.hidden.shape[0] * self.hidden.shape[1]

    @property
    def has_prompts(self) -> bool:
        return any(prompt is not None for prompt in self.prompts)

    def empty(self) -> StepArgs:
        """The same step with no tokens (computes nothing; a continued session rewinds with it)."""
        return StepArgs(self.hidden[:, :0], [None] * len(self.prompts))


@dataclass(frozen=True)
class Resume:
    """A first request's ``resume``: continue the client's session kept under ``key``, with this step's
    tokens starting at ``position``."""

    key: str
    position: int


MAX_KEY_CHARACTERS = 256  # of a kept session's key


def blocks_named(uid_chain: str, served: Mapping[str, B], description: str) -> list[B]:
    """The served blocks a request's uid chain names, in its order; ``description`` says what is served."""
    uids = parse_uid_chain(uid_chain)
    if not uids:
        raise WireError("the request names no block uids")
    missing = [uid for uid in uids if uid not in served]
    if missing:
        raise NotServedError(f"this server does not serve {', '.join(missing[:3])}; it serves {description}")
    return [served[uid] for uid in uids]


def check_adapter(adapter: Any, available: Sequence[str]) -> str | None:
    """The request's ``active_adapter`` (None: the base model), if this server preloaded it."""
    if adapter and adapter not in available:
        raise WireError(
            f"unknown adapter {shown(adapter)}; this server has: {', '.join(available) or 'none'}"
        )
    return adapter or None


def check_hidden(
    hidden: torch.Tensor, hidden_size: int, max_tokens: int, *, allow_empty: bool
) -> torch.Tensor:
    if not hidden.is_floating_point():
        raise WireError(f"hidden states must be a floating-point tensor, got {hidden.dtype}")
    if hidden.ndim != 3:
        raise WireError(f"hidden states must have shape [batch, length, hidden], got {list(hidden.shape)}")
    if hidden.shape[-1] != hidden_size:
        raise WireError(f"hidden size is {hidden.shape[-1]}, this model's is {hidden_size}")
    if hidden.shape[0] == 0 or (hidden.shape[1] == 0 and not allow_empty):
        raise WireError(f"hidden states are empty: shape {list(hidden.shape)}")
    tokens = hidden.shape[0] * hidden.shape[1]
    if tokens > max_tokens:
        raise WireError(
            f"the request has {tokens} tokens (batch × length), more than this server's "
            f"--max_batch_size {max_tokens}; split it"
        )
    return hidden


def check_prompts(
    prompts: torch.Tensor | None, num_blocks: int, hidden: torch.Tensor
) -> list[torch.Tensor | None]:
    """Deep prompts ``[blocks, batch or 1, pre_len, hidden]``, one per block (None: no prompts)."""
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


def check_hypo_ids(hypo_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Beam reorder ids: int64 ``[batch_size]`` within the batch (the cache's own rule, as a wire error)."""
    if hypo_ids.dtype != torch.int64:
        raise WireError(
            f"hypo_ids must be int64 of shape [{batch_size}], got {hypo_ids.dtype} {list(hypo_ids.shape)}"
        )
    try:
        _check_reorder(hypo_ids, batch_size)
    except ValueError as error:
        raise WireError(str(error)) from None
    return hypo_ids


def forward_args(
    tensors: list[torch.Tensor], structure: Any, num_blocks: int, hidden_size: int, max_tokens: int
) -> StepArgs:
    """rpc_forward's ``(hidden_states, prompts)``."""
    args = unpack_args(tensors, structure)
    if not args:
        raise WireError("rpc_forward expects (hidden_states, prompts)")
    hidden = check_hidden(args[0], hidden_size, max_tokens, allow_empty=False)
    return StepArgs(hidden, check_prompts(args[1] if len(args) > 1 else None, num_blocks, hidden))


def backward_args(
    tensors: list[torch.Tensor], structure: Any, num_blocks: int, hidden_size: int, max_tokens: int
) -> tuple[StepArgs, torch.Tensor]:
    """rpc_backward's ``(inputs, grad_outputs, prompts)``: the inputs with their prompts, and the gradients."""
    args = unpack_args(tensors, structure)
    if len(args) < 2:
        raise WireError("rpc_backward expects (inputs, grad_outputs, prompts)")
    hidden = check_hidden(args[0], hidden_size, max_tokens, allow_empty=False)
    grad = check_hidden(args[1], hidden_size, max_tokens, allow_empty=False)
    if grad.shape != hidden.shape:
        raise WireError(f"grad_outputs shape {list(grad.shape)} differs from inputs {list(hidden.shape)}")
    return StepArgs(hidden, check_prompts(args[2] if len(args) > 2 else None, num_blocks, hidden)), grad


def inference_args(
    tensors: list[torch.Tensor], structure: Any, num_blocks: int, hidden_size: int, max_tokens: int
) -> StepArgs:
    """An inference step's ``(hidden_states, prompts, hypo_ids)``; hypo_ids are checked against the session."""
    args = unpack_args(tensors, structure)
    if not args:
        raise WireError("an inference step expects (hidden_states, prompts, hypo_ids)")
    hidden = check_hidden(args[0], hidden_size, max_tokens, allow_empty=True)
    prompts = check_prompts(args[1] if len(args) > 1 else None, num_blocks, hidden)
    hypo_ids = args[2] if len(args) > 2 and not is_dummy(args[2]) else None
    return StepArgs(hidden, prompts, hypo_ids)


def check_max_length(metadata: Mapping[str, Any], limit: int) -> int:
    """The session length a first inference request asks for."""
    max_length = metadata.get("max_length")
    if max_length is None:
        raise WireError("the first inference request must carry metadata max_length")
    if max_length > limit:
        raise WireError(f"max_length {max_length} exceeds this server's --inference_max_length {limit}")
    return max_length


def check_keep(key: Any) -> str | None:
    """A request's ``keep``: the key (its client's choice) to keep the session under when it ends."""
    return None if key is None else _check_key(key, "keep")


def _check_key(key: Any, field: str) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARACTERS:
        raise WireError(f"{field} must be a string of 1 to {MAX_KEY_CHARACTERS} characters, got {shown(key)}")
    return key


def check_resume(resume: Any, max_length: int) -> Resume | None:
    """A first request's ``resume``: ``{"key": str, "position": int}``, the position within ``max_length``."""
    if resume is None:
        return None
    if not isinstance(resume, dict) or set(resume) != {"key", "position"}:
        raise WireError(f"resume must be {{'key': str, 'position': int}}, got {shown(resume)}")
    position = resume["position"]
    if type(position) is not int or not 0 <= position <= max_length:
        raise WireError(
            f"resume position must be an integer from 0 to max_length {max_length}, got {shown(position)}"
        )
    return Resume(_check_key(resume["key"], "resume key"), position)


def check_step_position(position: int, start: int | None, new_tokens: int, max_length: int) -> int:
    """Where a step starts (``start_from_position`` rewinds), if it fits the session."""
    if start is not None and start > position:
        raise WireError(f"start_from_position {start} is beyond the {position} tokens processed so far")
    position = position if start is None else start
    if position + new_tokens > max_length:
        raise WireError(
            f"Maximum length exceeded: {position} tokens so far + {new_tokens} new > max_length {max_length}"
        )
    return position


def check_output_compression(compressions: Any, count: int) -> list[Any] | None:
    """Per-output codecs a request asks for (None: uncompressed)."""
    if compressions is not None and len(compressions) != count:
        raise WireError(f"output_compression has {len(compressions)} entries for {count} outputs")
    return compressions


def max_request_bytes(max_batch_size: int, hidden_size: int, num_blocks: int) -> int:
    """The largest request the limits allow: hidden states, their gradients and deep prompts for every
    block, at most ``max_batch_size`` tokens each, in the widest wire dtype, plus room for metadata."""
    widest = max(dtype.itemsize for dtype in WIRE_DTYPES.values())
    return max_batch_size * hidden_size * widest * (2 + num_blocks) + 2**16
