"""The OpenAI API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Requests are validated before any work, strictly (``"3"`` is no integer, ``"yes"`` no boolean; bounded
values out of range are a 400, an unknown model a 404), and prompts are tokenized off the event loop.
The first event of a generation is awaited before the response starts, so a swarm that lacks blocks is
a 503 naming them (with ``Retry-After`` where its servers are only banned for now) rather than a stream
that breaks. ``stream: true`` sends server-sent events ending with ``data: [DONE]``, or with an error
event; a client that disconnects, before its first token too, cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from petals.api.errors import APIError, generation_error
from petals.api.service import Chunk, Events, Finished, ModelService, Sampling, cancel_on_disconnect
from petals.api.text import MAX_STOP_LENGTH, StreamingText

MAX_STOP_STRINGS = 4
INT64 = 2**63  # seeds are 64-bit integers (torch.Generator.manual_seed)

# accepted when absent or at their default value only: anything else is refused, not silently ignored
UNSUPPORTED_UNLESS = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}


# ---- requests ------------------------------------------------------------------------------------


STRICT = ConfigDict(strict=True)  # no coercion: "3" is no integer, "yes" no boolean


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    # OpenAI clients send fields we need not know ("user", ...)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class ContentPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]


# ---- routes --------------------------------------------------------------------------------------


def openai_router(service: ModelService) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = int(time.time())

    def model_card(served: ModelService) -> dict[str, Any]:
        return {"id": served.model_id, "object": "model", "created": created, "owned_by": "petals"}

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(served) for served in service.served]}

    @router.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        return model_card(_model_service(service, model_id))

    @router.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        served = _check_common(service, body)
        messages = [message.as_template_input() for message in body.messages]
        try:  # off the event loop: a long prompt must not stall every other request
            prompt_ids = await asyncio.to_thread(served.encode_chat, messages)
        except Exception as error:  # jinja template errors: roles out of order, unsupported content
            raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from error
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _complete(served, request, body, prompt_ids, max_tokens, _chat_format)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        served = _check_common(service, body)
        prompt_ids = await asyncio.to_thread(_prompt_ids, served, body.prompt)
        return await _complete(served, request, body, prompt_ids, body.max_tokens, _completion_format)

    return router


def _model_service(service: ModelService, name: str) -> ModelService:
    served = service.for_model(name)
    if served is None:
        names = ", ".join(f"'{each.model_id}'" for each in service.served)
        raise APIError(
            404,
            f"The model '{name[:100]}' does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )
    return served


def _check_common(service: ModelService, body: _GenerationRequest) -> ModelService:
    served = _model_service(service, body.model)
    if body.n not in (None, 1):
        raise APIError(400, f"n={body.n} is not supported: petals api returns one choice (n=1)", param="n")
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED_UNLESS and value not in UNSUPPORTED_UNLESS[name]:
            raise APIError(400, f"the parameter '{name}' is not supported by petals api", param=name)
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop sequences are allowed", param="stop")
    if any(len(stop) > MAX_STOP_LENGTH for stop in stops):
        raise APIError(400, f"a stop sequence may have at most {MAX_STOP_LENGTH} characters", param="stop")
    return served


def _prompt_ids(service: ModelService, prompt: str | list) -> list[int]:
    if isinstance(prompt, str):
        return service.encode_text(prompt)
    if prompt and all(isinstance(item, int) for item in prompt):
        vocab_size = service.model.config.vocab_size
        if not all(0 <= item < vocab_size for item in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return list(prompt)
    if len(prompt) == 1:
        return _prompt_ids(service, prompt[0])
    raise APIError(400, "exactly one prompt per request is supported", param="prompt")


def _max_new_tokens(service: ModelService, requested: int | None, prompt_tokens: int) -> int:
    cap = service.limits.max_new_tokens
    if requested is not None and requested > cap:
        raise APIError(
            400,
            f"max_tokens={requested} exceeds this server's limit of {cap} (petals api --max_tokens)",
            param="max_tokens",
        )
    if prompt_tokens == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    if requested is None and service.context_length is not None:
        requested = max(min(cap, service.context_length - prompt_tokens), 1)
    max_new_tokens = requested or cap
    try:
        service.check_length(prompt_tokens, max_new_tokens)
    except ValueError as error:
        raise APIError(400, str(error), code="context_length_exceeded") from error
    return max_new_tokens


def _sampling(body: _GenerationRequest) -> Sampling:
    temperature = 1.0 if body.temperature is None else body.temperature
    return Sampling(temperature=temperature, top_p=body.top_p or 1.0, seed=body.seed)


async def _complete(
    service: ModelService,
    request: Request,
    body: _GenerationRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    format: Callable[..., dict[str, Any]],
):
    max_new_tokens = _max_new_tokens(service, max_tokens, len(prompt_ids))
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    text = StreamingText(service.tokenizer, stop)
    try:
        events = service.stream(prompt_ids, max_new_tokens, _sampling(body), text)
    except Exception as error:  # no place left
        raise generation_error(error) from error
    reply = _Reply(service.model_id, format)
    watcher = asyncio.ensure_future(cancel_on_disconnect(request.receive, events))
    try:
        first = await _next(events)  # the swarm's errors become a status code before the response starts
        if not body.stream:
            return await _collect(reply, events, first)
    except BaseException:
        events.cancel()
        raise
    finally:
        watcher.cancel()  # a stream's response watches for the client leaving itself
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(
        _server_sent_events(reply, events, first, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _next(events: Events) -> Chunk | Finished:
    try:
        return await events.get()
    except Exception as error:
        raise generation_error(error) from error


async def _collect(reply: _Reply, events: Events, event: Chunk | Finished) -> dict:
    parts = []
    while not isinstance(event, Finished):
        parts.append(event.text)
        event = await _next(events)
    return reply.whole("".join(parts), event)


async def _server_sent_events(
    reply: _Reply, events: Events, event: Chunk | Finished, include_usage: bool
) -> AsyncIterator[str]:
    try:
        if reply.chat:  # chat streams open with the assistant's role
            yield _sse(reply.chunk("", None, include_usage))
        while not isinstance(event, Finished):
            if event.text:
                yield _sse(reply.chunk(event.text, None, include_usage))
            try:
                event = await _next(events)
            except APIError as error:  # the response has started: the error travels as an event
                yield _sse(error.body())
                return
        yield _sse(reply.chunk(None, event.reason, include_usage))
        if include_usage:
            yield _sse({**reply.envelope(), "choices": [], "usage": _usage(event)})
        yield "data: [DONE]\n\n"
    finally:
        events.cancel()  # a no-op after [DONE]; stops the generation when the client has gone


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(finished: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


# ---- the two response formats --------------------------------------------------------------------


class _Reply:
    """The response objects of one request: chat or text completion (``format`` says which)."""

    def __init__(self, model_id: str, format: Callable[..., dict[str, Any]]) -> None:
        self.model_id, self.format = model_id, format
        self.chat = format is _chat_format
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, streamed: bool = True) -> dict[str, Any]:
        kind = (
            ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}

    def chunk(self, text: str | None, finish_reason: str | None, include_usage: bool) -> dict[str, Any]:
        choice = self.format(text, finish_reason, streamed=True)
        payload = {**self.envelope(), "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    def whole(self, text: str, finished: Finished) -> dict[str, Any]:
        choice = self.format(text, finished.reason, streamed=False)
        return {**self.envelope(streamed=False), "choices": [choice], "usage": _usage(finished)}


def _chat_format(text: str | None, finish_reason: str | None, streamed: bool) -> dict[str, Any]:
    if not streamed:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    delta: dict[str, Any] = {}
    if text == "":
        delta = {"role": "assistant", "content": ""}
    elif text is not None:
        delta = {"content": text}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _completion_format(text: str | None, finish_reason: str | None, streamed: bool) -> dict[str, Any]:
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
