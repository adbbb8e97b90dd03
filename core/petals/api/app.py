"""The ASGI application of ``petals api`` (FastAPI) and how it is served (uvicorn).

Two plain ASGI middlewares stand in front of every route: the guard (``guard``: the Host header, the
page a request comes from, the API key; the chat page at ``/`` itself stays public: it asks for the
key), and a cap on request bodies, read and counted before any route sees them. Every error, FastAPI's
own 404, 405 and validation errors included, answers in OpenAI's shape (``errors``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from petals.api.chat_api import chat_api_router
from petals.api.errors import APIError, send_error
from petals.api.guard import ASGIApp, Guard, GuardMiddleware
from petals.api.openai_routes import openai_router
from petals.api.service import ModelService
from petals.client.kept_sessions import KeptSessions
from petals.client.suspects import Suspects

logger = logging.getLogger(__name__)


def service_metrics(service: ModelService) -> str:
    """How many generations and WebSocket sessions hold a place now, in Prometheus' text format."""
    gauges = [
        (
            "petals_api_requests_in_progress",
            "Generations running or waiting for the swarm",
            service.in_progress,
        ),
        (
            "petals_api_websocket_sessions",
            "Open WebSocket sessions of the Petals chat API",
            service.chat_sessions,
        ),
    ]
    return "".join(
        f"# HELP {name} {text}\n# TYPE {name} gauge\n{name} {places.taken}\n{name}_limit {places.limit}\n"
        for name, text, places in gauges
    )


def kept_session_metrics(kept: KeptSessions) -> str:
    """How often requests continued a kept session (``petals.client.kept_sessions``), in Prometheus' format."""
    samples = [
        (
            "petals_api_kept_sessions",
            "gauge",
            "Finished requests' sessions kept for their chat's next turn",
            len(kept),
        ),
        (
            "petals_api_sessions_continued_total",
            "counter",
            "Requests that continued a kept session",
            kept.continued,
        ),
        (
            "petals_api_reused_tokens_total",
            "counter",
            "Prompt tokens those requests did not compute again",
            kept.reused_tokens,
        ),
    ]
    return "".join(
        f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name} {value}\n" for name, kind, text, value in samples
    )


def verification_metrics(suspects: Suspects) -> str:
    """The client's ``verify`` counts in Prometheus' text format."""
    counters = [
        (
            "petals_client_verified_steps_total",
            "Inference steps recomputed on a second server",
            suspects.checks,
        ),
        (
            "petals_client_verification_mismatches_total",
            "Verified steps where two servers disagreed",
            suspects.mismatches,
        ),
        (
            "petals_client_suspects_total",
            "Servers caught returning wrong outputs, banned for good",
            len(suspects),
        ),
    ]
    return "".join(
        f"# HELP {name} {text}\n# TYPE {name} counter\n{name} {value}\n" for name, text, value in counters
    )


def create_app(service: ModelService, guard: Guard | None = None) -> ASGIApp:
    """The application: routes, error handlers and, in front of them, ``guard`` and the body cap."""
    app = FastAPI(title="petals api", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(openai_router(service))
    app.include_router(chat_api_router(service))
    page = resources.files("petals.api").joinpath("static/index.html").read_text()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> str:
        return page

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
    async def metrics() -> str:
        suspects = service.model.remote_blocks.manager.suspects
        return service_metrics(service) + kept_session_metrics(service.kept) + verification_metrics(suspects)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    limited = _BodyLimit(app, service.limits.max_request_bytes)
    return GuardMiddleware(limited, guard or Guard())


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """A 400 naming every invalid field (``param``: the first one), or where the JSON breaks."""
    problems, params = [], []
    for item in error.errors():
        if item["type"] == "json_invalid":
            problems.append(f"the body is not valid JSON ({item.get('ctx', {}).get('error', 'malformed')})")
            continue
        fields = [str(part) for part in item["loc"][1:]] if item["loc"][:1] == ("body",) else []
        params.append(fields[0] if fields and not fields[0].isdigit() else None)
        where = ".".join(fields)
        problems.append(f"{where}: {item['msg']}" if where else item["msg"])
    param = next((name for name in params if name), None)
    return APIError(400, "invalid request: " + "; ".join(problems), param=param).response()


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's own errors (no such route: 404, a wrong method: 405) in OpenAI's shape."""
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = f"{request.method} {request.url.path}: {error.detail}"
    headers = dict(error.headers or {})  # a 405's Allow
    return APIError(error.status_code, message, code=codes.get(error.status_code), headers=headers).response()


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    """A route's unexpected failure: logged with its traceback, answered without it."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
    message = "an internal error of petals api; its log has the details"
    return APIError(500, message, type="server_error", code="internal_error").response()


class _BodyLimit:
    """Refuse HTTP bodies over ``limit`` bytes (413), declared or counted; the app gets the body whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Callable) -> None:
        message = f"the request body exceeds {self.limit} bytes (petals api --max_request_bytes)"
        await send_error(send, APIError(413, message, code="request_too_large"))


def _replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that hands out ``body`` first, then waits as the server's does (for a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (``port`` 0: any free port), so the address is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(app: ASGIApp, sock: socket.socket, service: ModelService) -> None:
    """Serve until SIGINT or SIGTERM, then return (the caller closes the model, and the demo its swarm)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own re-raises the signal after shutting down, which would skip our cleanup
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        log_level="info",
        ws_max_size=service.limits.max_request_bytes,
        timeout_graceful_shutdown=5,
    )
    Server(config).run(sockets=[sock])
