"""The ASGI application of ``petals api`` (FastAPI) and how it is served (uvicorn).

Two plain ASGI middlewares stand in front of every route: a bearer-token check when an API key is
set (the chat page at ``/`` itself stays public: it asks for the key), and a cap on request bodies,
read and counted before any route sees them.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from petals.api.chat_api import chat_api_router
from petals.api.openai_routes import APIError, openai_router
from petals.api.service import ModelService
from petals.client.suspects import Suspects

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
PUBLIC_PATHS = {"/", "/favicon.ico"}


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


def create_app(service: ModelService, api_key: str | None = None) -> ASGIApp:
    app = FastAPI(title="petals api", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(openai_router(service))
    app.include_router(chat_api_router(service))
    page = resources.files("petals.api").joinpath("static/index.html").read_text()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> str:
        return page

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
    async def metrics() -> str:
        return verification_metrics(service.model.remote_blocks.manager.suspects)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    guarded: ASGIApp = _BodyLimit(app, service.limits.max_request_bytes)
    if api_key:
        guarded = _BearerAuth(guarded, api_key)
    return guarded


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"] if part != "body")
        problems.append(f"{where}: {item['msg']}" if where else item["msg"])
    first = error.errors()[0]["loc"] if error.errors() else ()
    param = str(first[1]) if len(first) > 1 else None
    return APIError(400, "invalid request: " + "; ".join(problems), param=param).response()


async def _send_error(send: Callable, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _BearerAuth:
    """``Authorization: Bearer <key>`` on every HTTP request and WebSocket except the chat page."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await self._refuse(scope, send)
        await self.app(scope, receive, send)

    async def _refuse(self, scope: dict, send: Callable) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
            return
        message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
        await _send_error(send, APIError(401, message, code="invalid_api_key"))


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
        await _send_error(send, APIError(413, message, code="request_too_large"))


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
