"""transformers' ``generate`` over an inference session.

The servers hold the KV caches; the client passes transformers a ``RemotePastKeyValues`` that only
reports how many positions the session has seen and turns beam reorders into ``hypo_ids`` for the
next step. ``generate`` opens a session when none is active; inside an active session, several
calls continue it: earlier tokens are prepended (so repetition penalties see them) but not
recomputed, and each call returns the new inputs plus what it generated. Inputs that begin with
everything the session has seen (a chat client resending the conversation) are its continuation, not
new tokens to append: only the rest is computed, and the call returns them all, as ``generate`` would.

Across calls, ``generate(..., kept_sessions=KeptSessions())`` keeps each generation's session on its
servers and continues the one whose tokens the next inputs extend (``petals.client.kept_sessions``);
a session opened with ``keep=True`` and passed as ``session=`` again is continued the same way.

Speculative decoding is transformers' own assisted generation (``assistant_model=`` a local draft,
or ``prompt_lookup_num_tokens=``): each step sends the proposed tokens through the swarm at once,
and ``crop`` rolls the session back past the rejected ones (see ``InferenceSession.rollback``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from petals.client.inference_session import InferenceSession
from petals.client.kept_sessions import KeptSessions


class RemotePastKeyValues(Cache):
    """A cache with no tensors: the length seen by a remote session, and pending beam reorders."""

    def __init__(self, session: InferenceSession) -> None:
        super().__init__(layers=[])
        self.session = session

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.session.position

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.session.position + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_linear(self) -> list[bool]:
        return [False]  # an attention cache (transformers treats an empty layer list as all-linear)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.session.pending_hypo_ids = beam_idx.detach().cpu().to(torch.int64)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (assisted generation's rejected candidates)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to drop, got {tokens_to_remove}")
        self.session.rollback(self.session.position + tokens_to_remove)


class RemoteGenerationMixin:
    """Put in front of a transformers model class whose transformer blocks are a ``RemoteSequential``."""

    # transformers refuses assisted generation for models with fixed-size states (linear attention,
    # state-space layers), which cannot go back to a position; the remote session can
    # (``ServerSession.rollback``)
    _is_stateful = False

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        *args,
        session: InferenceSession | None = None,
        kept_sessions: KeptSessions | None = None,
        **kwargs,
    ):
        remote = self.remote_blocks
        if kept_sessions is not None:
            return self._generate_kept(kept_sessions, inputs, *args, **kwargs)
        if session is not None and remote.active_session is None:
            if session.kept:
                session.reopen(max(session.max_length, _continued_length(self, session, inputs, kwargs)))
            with remote.use_session(session):
                return self._generate_in_session(session, inputs, *args, **kwargs)
        if remote.active_session is not None:
            return self._generate_in_session(remote.active_session, inputs, *args, **kwargs)
        max_length = _session_length(self, inputs, kwargs)
        with remote.inference_session(max_length=max_length) as new_session:
            return self._generate_in_session(new_session, inputs, *args, **kwargs)

    def _generate_kept(self, kept_sessions: KeptSessions, inputs: torch.Tensor | None, *args, **kwargs):
        """``generate`` in the kept session ``inputs`` continue (or a new one), kept again afterwards."""
        remote = self.remote_blocks
        if remote.active_session is not None:
            raise ValueError(
                "kept_sessions chooses the session itself: call generate outside inference_session"
            )
        ids = kwargs.get("input_ids", inputs)
        session = kept_sessions.open(remote.manager, ids, _session_length(self, inputs, kwargs))
        with remote.use_session(session):
            output = self._generate_in_session(session, inputs, *args, **kwargs)
        kept_sessions.put(session)
        return output

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """transformers' check of ``generate``'s extra arguments, less the two this mixin passes itself:
        it reads the accepted names from ``prepare_inputs_for_generation`` and, where that takes
        ``**kwargs`` only (some families'), from ``forward``, whose distributed one takes ``*args, **kwargs``."""
        ours = ("cache", "attention_mask")
        super()._validate_model_kwargs({key: value for key, value in model_kwargs.items() if key not in ours})

    def _generate_in_session(self, session: InferenceSession, inputs: torch.Tensor | None, *args, **kwargs):
        inputs = kwargs.pop("input_ids", inputs)
        _check_unpadded(kwargs.pop("attention_mask", None), inputs)
        previous = session.output_ids
        resent = previous is not None and inputs is not None and _extends(inputs, previous)
        if previous is not None and not resent:
            inputs = previous if inputs is None else torch.cat([previous, inputs.to(previous.device)], dim=1)
        if inputs is None:
            raise ValueError("generate needs input_ids (or a session that has already seen some)")
        if session.tokens >= inputs.shape[1]:  # a generation computes at least its last input
            session.rollback(inputs.shape[1] - 1 + session.prompt_length)
        kwargs["cache"] = RemotePastKeyValues(session)
        kwargs["attention_mask"] = torch.ones_like(inputs)
        output = super().generate(inputs, *args, **kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        session.output_ids = sequences
        if previous is None or resent:
            return output
        if isinstance(output, torch.Tensor):
            return output[:, previous.shape[1] :]
        output.sequences = sequences[:, previous.shape[1] :]
        return output


def _extends(inputs: torch.Tensor, previous: torch.Tensor) -> bool:
    """Whether ``inputs`` begin with all of ``previous`` (the session's tokens sent again)."""
    length = previous.shape[1]
    return (
        inputs.shape[0] == previous.shape[0]
        and inputs.shape[1] >= length
        and torch.equal(inputs[:, :length].to(previous.device), previous)
    )


def _continued_length(model, session: InferenceSession, inputs: torch.Tensor | None, kwargs: dict) -> int:
    """The positions a generation continuing ``session`` needs: ``_session_length`` of its inputs, plus
    the session's earlier tokens where the inputs are appended to them."""
    length = _session_length(model, inputs, kwargs)
    previous, ids = session.output_ids, kwargs.get("input_ids", inputs)
    if previous is not None and not (ids is not None and _extends(ids, previous)):
        length += previous.shape[1]
    return length


def _session_length(model, inputs: torch.Tensor | None, kwargs: dict) -> int:
    input_ids = kwargs.get("input_ids", inputs)
    input_length = input_ids.shape[1] if input_ids is not None else 0
    if kwargs.get("max_new_tokens") is not None:
        length = input_length + kwargs["max_new_tokens"]
    elif kwargs.get("max_length") is not None:
        length = kwargs["max_length"]
    elif (
        kwargs.get("generation_config") is not None and kwargs["generation_config"].max_new_tokens is not None
    ):
        length = input_length + kwargs["generation_config"].max_new_tokens
    else:
        config = kwargs.get("generation_config") or model.generation_config
        length = max(config.max_length or 0, input_length + (config.max_new_tokens or 0))
    return length + model.prompt_length + _lookup_overshoot(model, kwargs)


def _lookup_overshoot(model, kwargs: dict) -> int:
    """Room for transformers' prompt lookup, which may propose past ``max_length`` (and trims afterwards)."""
    config = kwargs.get("generation_config") or model.generation_config
    return kwargs.get("prompt_lookup_num_tokens") or getattr(config, "prompt_lookup_num_tokens", None) or 0


def _check_unpadded(attention_mask: torch.Tensor | None, inputs: torch.Tensor | None) -> None:
    if attention_mask is None:
        return
    if inputs is not None and attention_mask.shape != inputs.shape:
        raise ValueError(
            f"attention_mask of shape {list(attention_mask.shape)} does not match inputs {list(inputs.shape)}"
        )
    if not bool(attention_mask.all()):
        raise ValueError(
            "padded batches are not supported: remote servers attend to every position, so all sequences of a "
            "batch must have the same length (attention_mask all ones). Generate for each length separately."
        )


class StepStats:
    """What speculative decoding saved: the inference steps sent through the swarm while in use.

    ``with StepStats(model) as stats: output = model.generate(...)``, then ``stats.describe(...)``.
    A step sends the last accepted token plus the proposals (the first one: the prompt plus proposals)
    and yields one token of its own after the accepted proposals, so proposals and acceptances follow
    from the step lengths and the output length alone.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.lengths: list[int] = []  # positions sent by each step

    def __enter__(self) -> StepStats:
        self._hook = self.model.remote_blocks.register_forward_hook(self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        self._hook.remove()

    def _record(self, module, args: tuple, output: torch.Tensor) -> None:
        self.lengths.append(args[0].shape[1])

    @property
    def steps(self) -> int:
        return len(self.lengths)

    def proposed(self, prompt_length: int) -> int:
        return sum(self.lengths) - prompt_length - max(self.steps - 1, 0)

    def accepted(self, new_tokens: int) -> int:
        return new_tokens - self.steps

    def rolled_back(self, total_length: int) -> int:
        """Positions sent but dropped again (the servers saw every token but the last one once)."""
        return sum(self.lengths) - (total_length - 1)

    def acceptance_rate(self, prompt_length: int, new_tokens: int) -> float | None:
        proposed = self.proposed(prompt_length)
        return self.accepted(new_tokens) / proposed if proposed else None

    def describe(self, prompt_length: int, new_tokens: int) -> str:
        text = f"{new_tokens} tokens in {self.steps} steps through the swarm"
        if self.steps:
            text += f" ({new_tokens / self.steps:.2f} per step)"
        proposed = self.proposed(prompt_length)
        if proposed:
            accepted = self.accepted(new_tokens)
            text += f"; proposals accepted: {accepted} of {proposed} ({accepted / proposed:.0%})"
        return text
