"""The original Petals chat app's API, so its existing front-ends connect unchanged.

``POST /api/v1/generate`` (form or JSON fields: ``inputs``, ``max_length`` or ``max_new_tokens``,
``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``) answers
``{"ok": true, "outputs": ...}`` or ``{"ok": false, "traceback": ...}`` (here: a one-line error, no
server internals).

WebSocket ``/api/v2/generate``: first ``{"type": "open_inference_session", "max_length": N}``
(answered ``{"ok": true}``), then any number of ``{"type": "generate", "inputs": ..., ...}`` turns in
that one inference session, which lives as long as the connection. Without ``stop_sequence`` a turn
is answered once, with all its outputs; with one, tokens stream as ``{"ok", "outputs", "stop",
"token_count"}`` until the text ends with it (or with one of ``extra_stop_sequences``, after which the
session continues as if ``stop_sequence``, a single token, had been generated). Outputs keep special
tokens and stop sequences, as the original's did; its front-ends strip them. A turn that would
exceed the session's ``max_length`` fails with "Maximum length exceeded" (front-ends reopen a longer
session on that message).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect

from petals.api.service import Events, Finished, ModelService, Sampling
from petals.api.text import StreamingText

logger = logging.getLogger(__name__)

_CLOSE = None  # the command that ends a WebSocket's worker
_OPENED = "inference session opened"  # the worker's first event


class ChatAPIError(ValueError):
    """A request the chat API refuses; its message is what the client sees."""


# ---- parameters ----------------------------------------------------------------------------------


def _typed(fields: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = fields.get(name)
    if value is None or value == "":
        return default
    try:
        if kind is bool and isinstance(value, str):
            return bool(int(value)) if value.isdigit() else value.lower() == "true"
        return kind(value)
    except (TypeError, ValueError) as error:
        raise ChatAPIError(f"{name} must be {kind.__name__}, got {value!r}") from error


def _sampling(fields: dict[str, Any]) -> Sampling:
    repetition_penalty = _typed(fields, "repetition_penalty", float)
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ChatAPIError("repetition_penalty must be > 0")
    if not _typed(fields, "do_sample", bool, False):
        return Sampling(temperature=0, repetition_penalty=repetition_penalty)
    temperature = _typed(fields, "temperature", float, 1.0)
    top_p = _typed(fields, "top_p", float, 1.0)
    top_k = _typed(fields, "top_k", int)
    if temperature <= 0 or not 0 < top_p <= 1 or (top_k is not None and top_k < 1):
        raise ChatAPIError("sampling needs temperature > 0, 0 < top_p <= 1 and top_k >= 1")
    return Sampling(temperature, top_p, top_k, repetition_penalty)


def _max_new_tokens(fields: dict[str, Any], used: int, service: ModelService) -> int:
    """From ``max_new_tokens`` or ``max_length`` (total, including everything seen so far)."""
    max_new_tokens = _typed(fields, "max_new_tokens", int)
    max_length = _typed(fields, "max_length", int)
    if max_new_tokens is None and max_length is not None:
        max_new_tokens = max_length - used
    if max_new_tokens is None:
        raise ChatAPIError("pass max_new_tokens or max_length")
    if not 1 <= max_new_tokens <= service.limits.max_new_tokens:
        raise ChatAPIError(
            f"{max_new_tokens} new tokens requested; this server generates 1 to "
            f"{service.limits.max_new_tokens} per request (petals api --max_tokens)"
        )
    return max_new_tokens


def _check_model(fields: dict[str, Any], service: ModelService) -> ModelService:
    """The service of the requested ``model`` (the main one if none is named)."""
    model = fields.get("model")
    served = service if model is None else service.for_model(str(model))
    if served is None:
        names = ", ".join(repr(each.model_id) for each in service.served)
        raise ChatAPIError(f"model {model!r} is not served here; this server serves {names}")
    return served


def _error(error: BaseException) -> dict[str, Any]:
    return {"ok": False, "traceback": f"{type(error).__name__}: {error}"}


# ---- POST /api/v1/generate -----------------------------------------------------------------------


async def _request_fields(request: Request) -> dict[str, Any]:
    if request.headers.get("content-type", "").startswith("application/json"):
        fields = await request.json()
        if not isinstance(fields, dict):
            raise ChatAPIError("the JSON body must be an object")
        return fields
    form = await request.form()
    return {**request.query_params, **form}


async def _generate_once(service: ModelService, fields: dict[str, Any]) -> str:
    service = _check_model(fields, service)
    inputs = fields.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise ChatAPIError("pass the prompt as inputs")
    prompt_ids = service.encode_text(inputs)
    max_new_tokens = _max_new_tokens(fields, len(prompt_ids), service)
    service.check_length(len(prompt_ids), max_new_tokens)
    text = StreamingText(service.tokenizer, skip_special_tokens=False)
    events = service.stream(prompt_ids, max_new_tokens, _sampling(fields), text)
    try:
        while not isinstance(await events.get(), Finished):
            pass
    finally:
        events.cancel()
    return text.text


# ---- WebSocket /api/v2/generate ------------------------------------------------------------------


class _Turn:
    """One ``generate`` message, checked, as the worker thread runs it."""

    def __init__(self, fields: dict[str, Any], service: ModelService) -> None:
        if fields.get("type") != "generate":
            raise ChatAPIError(f"expected a message of type 'generate', got {fields.get('type')!r}")
        inputs = fields.get("inputs")
        if inputs is not None and not isinstance(inputs, str):
            raise ChatAPIError("inputs must be a string")
        self.input_ids = service.encode_text(inputs) if inputs else []
        self.fields = fields
        self.sampling = _sampling(fields)
        self.stop_sequence = fields.get("stop_sequence")
        extra = fields.get("extra_stop_sequences") or []
        if not isinstance(extra, list) or not all(isinstance(item, str) for item in extra):
            raise ChatAPIError("extra_stop_sequences must be a list of strings")
        self.extra_stop_sequences = extra
        self.continuation: int | None = None
        if extra:
            ids = service.encode_text(self.stop_sequence or "", add_special_tokens=False)
            if len(ids) != 1:
                raise ChatAPIError("extra_stop_sequences need a stop_sequence of exactly one token")
            self.continuation = ids[0]


class _ChatSession:
    """A WebSocket's inference session, run by one worker thread that takes turns from ``commands``."""

    def __init__(self, service: ModelService, max_length: int) -> None:
        self.service, self.max_length = service, max_length
        self.commands: queue.Queue[_Turn | None] = queue.Queue()

    def run(self, events: Events) -> None:
        with self.service.session(self.max_length, events) as session:
            events.put(_OPENED)
            while (turn := self.commands.get()) is not _CLOSE and not events.cancelled.is_set():
                events.put(self._turn(session, turn, events))

    def _turn(self, session, turn: _Turn, events: Events) -> Finished:
        used = 0 if session.output_ids is None else session.output_ids.shape[1]
        left = self.max_length - used - len(turn.input_ids)
        if turn.stop_sequence is None:
            max_new_tokens = _max_new_tokens(turn.fields, used + len(turn.input_ids), self.service)
        else:  # continue until the stop sequence, as far as the session allows
            max_new_tokens = min(left, self.service.limits.max_new_tokens)
        if max_new_tokens > left or max_new_tokens < 1:
            raise ChatAPIError(
                f"Maximum length exceeded: the session holds {self.max_length} tokens, {used} are used, "
                f"this turn needs {len(turn.input_ids)} + {max(max_new_tokens, 1)}; open a longer session"
            )
        stops = [turn.stop_sequence, *turn.extra_stop_sequences] if turn.stop_sequence else []
        text = StreamingText(self.service.tokenizer, stops, skip_special_tokens=False, include_stop=True)
        finished = self.service.generate(events, turn.input_ids, max_new_tokens, turn.sampling, text)
        if turn.stop_sequence is not None and not text.stopped and finished.reason == "length":
            raise ChatAPIError(
                f"Maximum length exceeded: no stop sequence within {max_new_tokens} tokens; open a longer session"
            )
        if turn.continuation is not None and any(text.text.endswith(s) for s in turn.extra_stop_sequences):
            session.output_ids[0, -1] = turn.continuation  # the next turn goes on after stop_sequence
        return finished


async def _receive(websocket: WebSocket, timeout: float) -> dict[str, Any]:
    try:
        message = json.loads(await asyncio.wait_for(websocket.receive_text(), timeout))
    except json.JSONDecodeError as error:
        raise ChatAPIError(f"messages must be JSON: {error}") from error
    if not isinstance(message, dict):
        raise ChatAPIError("messages must be JSON objects")
    return message


async def _opening(websocket: WebSocket, service: ModelService) -> tuple[ModelService, int]:
    """The model and ``max_length`` of the first message, ``open_inference_session``, checked."""
    fields = await _receive(websocket, service.limits.session_timeout)
    if fields.get("type") != "open_inference_session":
        raise ChatAPIError("the first message must be of type 'open_inference_session'")
    service = _check_model(fields, service)
    max_length = _typed(fields, "max_length", int)
    if max_length is None or max_length < 1:
        raise ChatAPIError("open_inference_session needs max_length >= 1")
    if service.context_length is not None and max_length > service.context_length:
        raise ChatAPIError(f"max_length {max_length} exceeds the model's context of {service.context_length}")
    return service, max_length


async def _stream_turn(websocket: WebSocket, turn: _Turn, events: Events) -> None:
    streaming = turn.stop_sequence is not None
    parts, tokens = [], 0
    while not isinstance(event := await events.get(), Finished):
        parts.append(event.text)
        tokens += event.tokens
        if streaming and event.text:
            await websocket.send_json(
                {"ok": True, "outputs": "".join(parts), "stop": False, "token_count": tokens}
            )
            parts, tokens = [], 0
    await websocket.send_json({"ok": True, "outputs": "".join(parts), "stop": True, "token_count": tokens})


async def _serve_websocket(websocket: WebSocket, service: ModelService) -> None:
    events: Events | None = None
    session: _ChatSession | None = None
    try:
        service, max_length = await _opening(websocket, service)
        session = _ChatSession(service, max_length)
        events = service.start(session.run)
        await events.get()  # _OPENED, or the swarm's error raised here
        await websocket.send_json({"ok": True})
        while True:
            turn = _Turn(await _receive(websocket, service.limits.session_timeout), service)
            session.commands.put(turn)
            await _stream_turn(websocket, turn, events)
    except (TimeoutError, WebSocketDisconnect):
        pass
    except Exception as error:
        logger.info("WebSocket session ended: %s: %s", type(error).__name__, str(error)[:200])
        with contextlib.suppress(Exception):
            await websocket.send_json(_error(error))
    finally:  # the worker leaves its inference session, which frees the servers' caches
        if events is not None:
            events.cancel()
        if session is not None:
            session.commands.put(_CLOSE)
        with contextlib.suppress(Exception):
            await websocket.close()


def chat_api_router(service: ModelService) -> APIRouter:
    router = APIRouter(prefix="/api")

    @router.post("/v1/generate")
    async def generate_v1(request: Request) -> dict[str, Any]:
        try:
            return {"ok": True, "outputs": await _generate_once(service, await _request_fields(request))}
        except Exception as error:
            return _error(error)

    @router.websocket("/v2/generate")
    async def generate_v2(websocket: WebSocket) -> None:
        await websocket.accept()
        await _serve_websocket(websocket, service)

    return router
