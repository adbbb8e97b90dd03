"""Errors as ``petals api`` answers them: OpenAI's shape, the right status, never a traceback or a path.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (the Petals chat API adds its own
``ok``/``traceback`` keys around it). ``generation_error`` is the one place where what a generation
raised becomes a status: the swarm's known failures keep their message (they say what to do), anything
else is logged here and answered as an internal error without its details.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from petals.client.inference_session import SessionCancelled
from petals.client.routing import MissingBlocksError, RequestRefused, RouteBanned, ServerFailure
from petals.network.client import SwarmUnreachableError

logger = logging.getLogger(__name__)


class ServiceBusyError(RuntimeError):
    """Too many requests are in progress."""


class Cancelled(Exception):
    """The client left before its generation started."""


class APIError(Exception):
    """An error in OpenAI's shape, with its HTTP status (and headers such as ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, body: dict[str, Any] | None = None) -> JSONResponse:
        return JSONResponse(body or self.body(), status_code=self.status, headers=self.headers)


def busy(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="server_busy", headers={"Retry-After": "1"})


def generation_error(error: BaseException) -> APIError:
    """What the client of a generation that raised ``error`` is answered."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RouteBanned):
        seconds = str(max(1, math.ceil(error.retry_after)))
        return APIError(
            503,
            str(error),
            type="server_error",
            code="swarm_missing_blocks",
            headers={"Retry-After": seconds},
        )
    if isinstance(error, MissingBlocksError):
        return APIError(503, str(error), type="server_error", code="swarm_missing_blocks")
    if isinstance(error, SwarmUnreachableError):
        return APIError(503, str(error), type="server_error", code="swarm_unreachable")
    if isinstance(error, ServiceBusyError):
        return busy(str(error))
    if isinstance(error, RequestRefused):
        return APIError(400, str(error), code="refused_by_server")
    if isinstance(error, ServerFailure):
        return APIError(502, str(error), type="server_error", code="swarm_server_failure")
    if not isinstance(error, SessionCancelled | Cancelled):  # nobody is left to answer
        logger.error("Generation failed", exc_info=error)
    return APIError(
        500,
        "generation failed with an internal error of petals api; its log has the details",
        type="server_error",
        code="internal_error",
    )


async def send_error(send: Callable, error: APIError) -> None:
    """``error`` as a whole JSON response from plain ASGI (a middleware, outside FastAPI's routes)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
