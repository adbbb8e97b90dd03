"""The one client model behind the APIs: generation in worker threads, streamed to asyncio.

torch and the client block, so every generation runs in a thread of its own and hands its events
(``Chunk`` of text, then ``Finished``, or the exception) to the event loop through ``Events``. The
consumer's ``cancel`` reaches the worker at once, even while it waits for a server or a backoff (the
inference session's ``cancel``), or at its next token: ``generate`` stops, and leaving the inference
session closes it on every server, which frees their caches and the request's place.

A request's session is kept when its generation ends (``petals.client.kept_sessions``): the next request
whose prompt extends its tokens (an OpenAI client's next turn, which sends the whole conversation again)
continues it from their common prefix instead of computing the conversation again. A request that fails
or whose client left closes its session for good. One client model per process, hence one p2p identity:
servers keep a session only for the peer that closed it.

Places are counted twice: ``max_in_progress`` generations at a time (a request, or one WebSocket turn),
and ``max_sessions`` open WebSocket sessions, so that idle chats never keep a generation from running.

Sampling uses a ``torch.Generator`` per request (``SeededSampler``): transformers would draw from
torch's global generator, which concurrent requests share, so a ``seed`` would reproduce nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from petals.api.errors import Cancelled, ServiceBusyError
from petals.api.text import StreamingText
from petals.client.kept_sessions import IDLE_SECONDS, MAX_SESSIONS, KeptSessions


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = 1024  # per request (and per WebSocket turn)
    max_request_bytes: int = 1 << 20
    max_in_progress: int = 64  # generations running or waiting for the swarm (requests, WebSocket turns)
    session_timeout: float = 300.0  # a WebSocket session idle longer than this is closed
    max_sessions: int = 64  # open WebSocket sessions (idle ones hold no generation place)
    kept_sessions: int = MAX_SESSIONS  # finished requests' sessions kept for the next turn of their chat
    kept_seconds: float = IDLE_SECONDS  # and for how long each, unused


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 means greedy decoding
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Chunk:
    text: str
    tokens: int  # new tokens this text comes from (0 for text released at the end)


@dataclass
class Finished:
    reason: str  # "stop" (end of sequence or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


class Events:
    """Events from a worker thread to one asyncio consumer; ``cancelled`` tells the worker to stop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self._on_cancel: list[Callable[[], None]] = []

    def put(self, event: Any) -> None:
        """From the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutting down): nobody is listening
            self.cancelled.set()

    async def get(self) -> Any:
        """The next event; an exception from the worker is raised here."""
        event = await self._queue.get()
        if isinstance(event, BaseException):
            raise event
        return event

    def cancel(self) -> None:
        """From the consumer: stop the worker, also where it waits (see ``on_cancel``)."""
        with self._lock:
            self.cancelled.set()
            callbacks, self._on_cancel = self._on_cancel, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """From the worker: call ``callback`` on ``cancel`` (at once if it came already)."""
        with self._lock:
            if not self.cancelled.is_set():
                self._on_cancel.append(callback)
                return
        callback()


class Places:
    """At most ``limit`` of something at a time (generations, WebSocket sessions), counted (``/metrics``)."""

    def __init__(self, limit: int, busy: str) -> None:
        self.limit, self.busy = limit, busy
        self._lock = threading.Lock()
        self.taken = 0

    def take(self) -> Callable[[], None]:
        """A place (``ServiceBusyError`` when none is left) and what gives it back (once, however called)."""
        with self._lock:
            if self.taken >= self.limit:
                raise ServiceBusyError(self.busy)
            self.taken += 1
        once = threading.Lock()

        def release() -> None:
            if once.acquire(blocking=False):
                with self._lock:
                    self.taken -= 1

        return release


class ModelService:
    """``model`` (an ``AutoDistributedModelForCausalLM``) and its tokenizer, shared by all requests."""

    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        limits: Limits,
        aliases: Sequence[str] = (),
        places: tuple[Places, Places] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.model_id, self.limits = model, tokenizer, model_id, limits
        self.names = {model_id, *aliases}
        # (generations in progress, open WebSocket sessions): shared with the variants
        self.in_progress, self.chat_sessions = places or (
            Places(
                limits.max_in_progress,
                f"{limits.max_in_progress} requests are already in progress; retry in a moment",
            ),
            Places(
                limits.max_sessions, f"{limits.max_sessions} WebSocket sessions are already open; retry later"
            ),
        )
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.variants: dict[str, ModelService] = {}
        self.kept = KeptSessions(limits.kept_sessions, limits.kept_seconds)

    def add_variant(self, model, model_id: str) -> ModelService:
        """Serve ``model`` (this one with trained prompts) as ``model_id`` too, within the same limits."""
        if self.for_model(model_id) is not None:
            raise ValueError(f"the model name {model_id!r} is already served")
        variant = ModelService(
            model, self.tokenizer, model_id, self.limits, places=(self.in_progress, self.chat_sessions)
        )
        self.variants[model_id] = variant
        return variant

    def for_model(self, name: str) -> ModelService | None:
        """The service of the model requested as ``name``: this one or a variant (None if neither)."""
        return self if name in self.names else self.variants.get(name)

    @property
    def served(self) -> list[ModelService]:
        return [self, *self.variants.values()]

    # ---- prompts -------------------------------------------------------------------------------

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The tokenizer's chat template with the assistant's turn opened; ValueError without one."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {self.model_id} has no chat template: use /v1/completions with a plain prompt"
            )
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if self.context_length is not None and prompt_tokens + max_new_tokens > self.context_length:
            raise ValueError(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_new_tokens}) exceeds the model's "
                f"context length of {self.context_length} tokens; shorten the prompt or lower max_tokens"
            )

    # ---- running generation --------------------------------------------------------------------

    def reserve(self) -> Callable[[], None]:
        """A generation place, or ``ServiceBusyError``; returns what gives it back."""
        return self.in_progress.take()

    def start(self, work: Callable[[Events], None], *, chat_session: bool = False) -> Events:
        """Run ``work(events)`` in a new thread, which holds a generation place (or, for a WebSocket's
        ``chat_session``, a session place: its turns ``reserve`` their own); its uncaught exception
        becomes the last event."""
        release = self.chat_sessions.take() if chat_session else self.reserve()
        events = Events()

        def run() -> None:
            try:
                work(events)
            except BaseException as error:  # delivered to the consumer, which decides what the client sees
                events.put(error)
            finally:
                release()

        threading.Thread(target=run, name="petals-api-generation", daemon=True).start()
        return events

    @contextlib.contextmanager
    def session(self, max_length: int, events: Events, prompt_ids: list[int] | None = None) -> Iterator[Any]:
        """An inference session of the shared model, for this worker thread only; ``events.cancel``
        cancels it, also while a step waits for a server. With ``prompt_ids``, the kept session they
        continue (or a new one), kept again if the generation ends well."""
        # the model is thread-safe: every request's thread has sessions of its own, side by side
        if events.cancelled.is_set():  # the client left while waiting for a place
            raise Cancelled
        if prompt_ids is None:
            opened = self.model.inference_session(max_length=max_length)
        else:
            manager, length = self.model.remote_blocks.manager, max_length + self.model.prompt_length
            opened = self.model.use_session(self.kept.open(manager, prompt_ids, length))
        with opened as session:
            events.on_cancel(session.cancel)
            yield session
        self.kept.put(session)

    def stream(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, text: StreamingText
    ) -> Events:
        """One generation in a session of its own (or the kept one its prompt continues): ``Chunk``
        events, then ``Finished``."""

        def work(events: Events) -> None:
            with self.session(len(prompt_ids) + max_new_tokens, events, prompt_ids):
                finished = self.generate(events, prompt_ids, max_new_tokens, sampling, text)
            events.put(finished)  # after the session is closed: the servers' caches are free (or lent) again

        return self.start(work)

    def generate(
        self,
        events: Events,
        input_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        text: StreamingText,
    ) -> Finished:
        """Generate in the active session, putting a ``Chunk`` per new token; returns how it ended."""
        step = _Step(text, events, self.eos_token_ids)
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,  # SeededSampler draws; greedy search then takes its choice
            repetition_penalty=sampling.repetition_penalty,
            eos_token_id=self.eos_token_ids or None,
            pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else 0,
        )
        processors = [] if sampling.greedy else [SeededSampler(sampling)]
        with torch.no_grad():
            self.model.generate(
                torch.tensor([input_ids], dtype=torch.int64),
                generation_config=config,
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([step]),
            )
        tail = text.flush()
        if tail:
            events.put(Chunk(tail, 0))
        reason = "stop" if step.ended_by_eos or text.stopped else "length"
        return Finished(reason, len(input_ids), step.count)


class _Step(StoppingCriteria):
    """Called by ``generate`` after every new token: stream its text, stop on a stop string or cancel."""

    def __init__(self, text: StreamingText, events: Events, eos_token_ids: list[int]) -> None:
        self.text, self.events, self.eos_token_ids = text, events, set(eos_token_ids)
        self.count = 0
        self.ended_by_eos = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        token = int(input_ids[0, -1])
        self.count += 1
        self.ended_by_eos = token in self.eos_token_ids
        self.events.put(Chunk(self.text.push(token), 1))
        stop = self.text.stopped or self.events.cancelled.is_set()
        return torch.tensor([stop], dtype=torch.bool, device=input_ids.device)


class SeededSampler(LogitsProcessor):
    """Draw the next token with this request's own generator; greedy search then takes that token."""

    def __init__(self, sampling: Sampling) -> None:
        self.warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.generator = torch.Generator()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        else:
            self.generator.seed()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probabilities = torch.softmax(scores.float(), dim=-1)
        chosen = torch.multinomial(probabilities, 1, generator=self.generator)
        return torch.full_like(scores, -float("inf")).scatter_(1, chosen, 0.0)


def _eos_token_ids(model, tokenizer) -> list[int]:
    configured = model.generation_config.eos_token_id
    if configured is None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return []
    return [configured] if isinstance(configured, int) else list(configured)


async def cancel_on_disconnect(receive: Callable[[], Any], events: Events) -> None:
    """Cancel ``events``' generation when the HTTP client of ``receive`` (ASGI) disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
    events.cancel()
