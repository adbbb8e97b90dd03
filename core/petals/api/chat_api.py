"""The original Petals chat app's API, so its existing front-ends connect unchanged.

``POST /api/v1/generate`` (form or JSON fields: ``inputs``, ``max_length`` or ``max_new_tokens``,
``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``) answers
``{"ok": true, "outputs": ...}``. Its errors keep the original's body, ``{"ok": false, "traceback": ...}``
(here a one-line message, no server internals), which its clients read, and add OpenAI's ``error``
object beside it, with a 4xx/5xx status instead of the original's 200.

WebSocket ``/api/v2/generate``: first ``{"type": "open_inference_session", "max_length": N}``
(answered ``{"ok": true}``), then any number of ``{"type": "generate", "inputs": ..., ...}`` turns in
that one inference session, which lives as long as the connection. Without ``stop_sequence`` a turn
is answered once, with all its outputs; with one, tokens stream as ``{"ok", "outputs", "stop",
"token_count"}`` until the text ends with it (or with one of ``extra_stop_sequences``, after which the
session continues as if ``stop_sequence``, a single token, had been generated). Outputs keep special
tokens and stop sequences, as the original's did; its front-ends strip them. A turn that would
exceed the session's ``max_length`` fails with "Maximum length exceeded" (front-ends reopen a longer
session on that message). A keyed API takes the key in the first message (``"api_key"``) where the
client sends no ``Authorization`` header (a browser cannot, on a WebSocket). An error ends the session
with ``{"ok": false, "traceback", "error"}``, except a turn refused because the API is busy, which the
client may send again.

Values are checked strictly, as the original's front-ends send them (numbers, or strings from a form):
``"3"`` is a number in a form, ``3.5`` is no integer, NaN and infinities are refused, stop sequences
are capped. A session holds a generation place only while a turn runs, so idle chats never make
other requests wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import queue
import re
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse

from petals.api.errors import APIError, Cancelled, ServiceBusyError, generation_error
from petals.api.guard import KEY_CHECK
from petals.api.service import Events, Finished, ModelService, Sampling, cancel_on_disconnect
from petals.api.text import MAX_STOP_LENGTH, StreamingText

logger = logging.getLogger(__name__)

_CLOSE = None  # the command that ends a WebSocket's worker
_OPENED = "inference session opened"  # the worker's first event
MAX_EXTRA_STOP_SEQUENCES = 16
_INTEGER = re.compile(r"[+-]?\d{1,30}")


class ChatAPIError(ValueError):
    """A request the chat API refuses; its message is what the client sees."""


# ---- parameters ----------------------------------------------------------------------------------


def _typed(fields: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """``fields[name]`` as ``kind`` (int, float or bool), strictly; ``default`` when absent or empty."""
    value = fields.get(name)
    if value is None or value == "":
        return default
    parsed = _parse_form_value(value, kind) if isinstance(value, str) else value
    if kind is bool and parsed in (0, 1) and not isinstance(parsed, float):
        return bool(parsed)
    if kind is int and isinstance(parsed, int) and not isinstance(parsed, bool):
        return parsed
    if kind is float and isinstance(parsed, int | float) and not isinstance(parsed, bool):
        if math.isfinite(parsed):
            return float(parsed)
    expected = {int: "a whole number", float: "a finite number", bool: "true, false, 0 or 1"}[kind]
    raise ChatAPIError(f"{name} must be {expected}, got {_shown(value)}")


def _parse_form_value(value: str, kind: type) -> Any:
    """A form field's text as ``kind``; the text itself where it is none (the caller refuses it)."""
    text = value.strip().lower()
    if kind is bool:
        return {"true": True, "false": False, "1": True, "0": False}.get(text, value)
    if _INTEGER.fullmatch(text):
        return int(text)
    if kind is float:
        with contextlib.suppress(ValueError):
            return float(text)
    return value


def _shown(value: Any) -> str:
    """``value`` as an error message quotes it: short, whatever it is."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
        raise ChatAPIError(f"model {_shown(model)} is not served here; this server serves {names}")
    return served


def _stop_sequences(fields: dict[str, Any]) -> tuple[str | None, list[str]]:
    """``stop_sequence`` and ``extra_stop_sequences``, checked and capped."""
    stop = fields.get("stop_sequence")
    if stop is not None and not isinstance(stop, str):
        raise ChatAPIError(f"stop_sequence must be a string, got {_shown(stop)}")
    extra = fields.get("extra_stop_sequences") or []
    if not isinstance(extra, list) or not all(isinstance(item, str) for item in extra):
        raise ChatAPIError("extra_stop_sequences must be a list of strings")
    if len(extra) > MAX_EXTRA_STOP_SEQUENCES:
        raise ChatAPIError(f"at most {MAX_EXTRA_STOP_SEQUENCES} extra_stop_sequences are allowed")
    if any(len(item) > MAX_STOP_LENGTH for item in [stop or "", *extra]):
        raise ChatAPIError(f"a stop sequence may have at most {MAX_STOP_LENGTH} characters")
    return stop, extra


def _answer(error: BaseException) -> APIError:
    """How a failed request is answered (``_body``): its own message if the chat API refused it."""
    return APIError(400, str(error)) if isinstance(error, ChatAPIError) else generation_error(error)


def _body(answer: APIError) -> dict[str, Any]:
    """The original's ``{"ok": false, "traceback"}`` (one line here), with OpenAI's ``error`` beside it."""
    return {"ok": False, "traceback": answer.message, **answer.body()}


# ---- POST /api/v1/generate -----------------------------------------------------------------------


async def _request_fields(request: Request) -> dict[str, Any]:
    try:
        if request.headers.get("content-type", "").startswith("application/json"):
            fields = await request.json()
        else:
            form = await request.form()
            fields = {**request.query_params, **form}
    except Exception as error:  # JSON or a form that does not parse (json, multipart: errors of their own)
        raise ChatAPIError(f"the body is neither a JSON object nor a form: {_shown(str(error))}") from error
    if not isinstance(fields, dict):
        raise ChatAPIError("the JSON body must be an object")
    return fields


async def _generate_once(service: ModelService, fields: dict[str, Any], request: Request) -> str:
    service = _check_model(fields, service)
    inputs = fields.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise ChatAPIError("pass the prompt as inputs")
    prompt_ids = await asyncio.to_thread(service.encode_text, inputs)
    max_new_tokens = _max_new_tokens(fields, len(prompt_ids), service)
    try:
        service.check_length(len(prompt_ids), max_new_tokens)
    except ValueError as error:
        raise ChatAPIError(str(error)) from error
    text = StreamingText(service.tokenizer, skip_special_tokens=False)
    events = service.stream(prompt_ids, max_new_tokens, _sampling(fields), text)
    watcher = asyncio.ensure_future(cancel_on_disconnect(request.receive, events))
    try:
        while not isinstance(await events.get(), Finished):
            pass
    finally:
        watcher.cancel()
        events.cancel()
    return text.text


# ---- WebSocket /api/v2/generate ------------------------------------------------------------------


class _Turn:
    """One ``generate`` message, checked (``parse``), as the worker thread runs it."""

    def __init__(self, fields: dict[str, Any], service: ModelService) -> None:
        """Checks every value of ``fields`` (``parse`` then tokenizes the inputs)."""
        if fields.get("type") != "generate":
            raise ChatAPIError(f"expected a message of type 'generate', got {_shown(fields.get('type'))}")
        self.inputs = fields.get("inputs")
        if self.inputs is not None and not isinstance(self.inputs, str):
            raise ChatAPIError("inputs must be a string")
        self.fields, self.sampling = fields, _sampling(fields)
        self.stop_sequence, self.extra_stop_sequences = _stop_sequences(fields)
        self.continuation: int | None = None  # what the session holds after an extra stop sequence
        if self.extra_stop_sequences:
            ids = service.encode_text(self.stop_sequence or "", add_special_tokens=False)
            if len(ids) != 1:
                raise ChatAPIError("extra_stop_sequences need a stop_sequence of exactly one token")
            self.continuation = ids[0]
        self.input_ids: list[int] = []
        self.release: Callable[[], None] = lambda: None  # gives the turn's generation place back

    @classmethod
    async def parse(cls, fields: dict[str, Any], service: ModelService) -> _Turn:
        """The turn of ``fields``, checked, its inputs tokenized off the event loop."""
        turn = cls(fields, service)
        if turn.inputs:
            turn.input_ids = await asyncio.to_thread(service.encode_text, turn.inputs)
        return turn


class _ChatSession:
    """A WebSocket's inference session, run by one worker thread that takes turns from ``commands``."""

    def __init__(self, service: ModelService, max_length: int) -> None:
        self.service, self.max_length = service, max_length
        self.commands: queue.Queue[_Turn | None] = queue.Queue()

    def run(self, events: Events) -> None:
        with self.service.session(self.max_length, events) as session:
            events.put(_OPENED)
            while (turn := self.commands.get()) is not _CLOSE:
                try:
                    if events.cancelled.is_set():
                        raise Cancelled  # the last event: nobody waits for this turn forever
                    events.put(self._turn(session, turn, events))
                finally:
                    turn.release()

    def _turn(self, session, turn: _Turn, events: Events) -> Finished:
        used = 0 if session.output_ids is None else session.output_ids.shape[1]
        if used == 0 and not turn.input_ids:
            raise ChatAPIError("the first turn of a session needs inputs")
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


class _ClientLeft(Exception):
    """The WebSocket's client closed the connection."""


class _Inbox:
    """The WebSocket's messages, read as they arrive, so that a client leaving is noticed at once, also
    while a turn generates (``on_leave``). One message waits at most: a client that sends faster is
    not read from until the turns catch up."""

    def __init__(self, websocket: WebSocket) -> None:
        self._messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=1)
        self._on_leave: list[Callable[[], None]] = []
        self._reader = asyncio.ensure_future(self._read(websocket))

    async def _read(self, websocket: WebSocket) -> None:
        try:
            while (message := await websocket.receive())["type"] != "websocket.disconnect":
                await self._messages.put(message)
        except Exception as error:  # the connection broke: as if the client had left
            logger.debug("WebSocket read failed: %s", error)
        finally:
            for callback in self._on_leave:
                callback()
            self._on_leave = []
            while not self._messages.empty():  # what a client that left still had to say is moot
                self._messages.get_nowait()
            self._messages.put_nowait(None)

    def on_leave(self, callback: Callable[[], None]) -> None:
        if self._reader.done():
            callback()
        else:
            self._on_leave.append(callback)

    async def next(self, timeout: float) -> dict[str, Any]:
        """The next message as a JSON object; ``TimeoutError`` after ``timeout`` idle seconds."""
        message = await asyncio.wait_for(self._messages.get(), timeout)
        if message is None:
            raise _ClientLeft
        if message.get("text") is None:
            raise ChatAPIError("messages must be text frames holding JSON objects, not binary ones")
        try:
            fields = json.loads(message["text"])
        except json.JSONDecodeError as error:
            raise ChatAPIError(f"messages must be JSON: {error}") from error
        if not isinstance(fields, dict):
            raise ChatAPIError("messages must be JSON objects")
        return fields

    def close(self) -> None:
        self._reader.cancel()


def _opening(
    fields: dict[str, Any], service: ModelService, key_check: Callable | None
) -> tuple[ModelService, int]:
    """The model and ``max_length`` of the first message, ``open_inference_session``, checked."""
    if key_check is not None and not key_check(fields.get("api_key")):
        message = "missing or wrong API key: pass it as api_key in the first message"
        raise APIError(401, message, type="authentication_error", code="invalid_api_key")
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


async def _take_turns(
    websocket: WebSocket, inbox: _Inbox, service: ModelService, session: _ChatSession, events: Events
) -> None:
    """Turn after turn until the client leaves or stays idle too long; a busy API refuses one turn only."""
    while True:
        turn = await _Turn.parse(await inbox.next(service.limits.session_timeout), service)
        try:
            turn.release = service.reserve()
        except ServiceBusyError as error:
            await websocket.send_json(_body(_answer(error)))
            continue
        session.commands.put(turn)
        await _stream_turn(websocket, turn, events)


async def _serve_websocket(websocket: WebSocket, service: ModelService) -> None:
    inbox = _Inbox(websocket)
    events: Events | None = None
    session: _ChatSession | None = None
    try:
        fields = await inbox.next(service.limits.session_timeout)
        service, max_length = _opening(fields, service, websocket.scope.get(KEY_CHECK))
        session = _ChatSession(service, max_length)
        events = service.start(session.run, chat_session=True)
        inbox.on_leave(events.cancel)
        await events.get()  # _OPENED
        await websocket.send_json({"ok": True})
        await _take_turns(websocket, inbox, service, session, events)
    except (TimeoutError, _ClientLeft):
        pass
    except Exception as error:
        answer = _answer(error)
        logger.info("WebSocket session ended (%d): %s", answer.status, answer.message[:200])
        with contextlib.suppress(Exception):
            await websocket.send_json(_body(answer))
    finally:  # the worker leaves its inference session, which frees the servers' caches
        inbox.close()
        if events is not None:
            events.cancel()
        if session is not None:
            session.commands.put(_CLOSE)
        with contextlib.suppress(Exception):
            await websocket.close()


def chat_api_router(service: ModelService) -> APIRouter:
    router = APIRouter(prefix="/api")

    @router.post("/v1/generate")
    async def generate_v1(request: Request) -> JSONResponse:
        try:
            outputs = await _generate_once(service, await _request_fields(request), request)
        except Exception as error:
            answer = _answer(error)
            return answer.response(_body(answer))
        return JSONResponse({"ok": True, "outputs": outputs})

    @router.websocket("/v2/generate")
    async def generate_v2(websocket: WebSocket) -> None:
        await websocket.accept()
        await _serve_websocket(websocket, service)

    return router
