"""Who may use ``petals api``: the Host a request names, the page it comes from, and the API key.

A web page the user visits can send requests to a local API: form posts and WebSockets cross origins
without asking, and a DNS name that an attacker rebinds to 127.0.0.1 makes his page same-origin with
the API. So, before any route:

* the ``Host`` header must be an IP address (a rebound name is never one), a loopback name
  (``localhost``, ``*.localhost``), the ``--host`` the API listens on, or one of ``--allow_host``;
* a request that carries an ``Origin`` (browsers send it with WebSockets, form posts and every
  cross-origin request) must come from the API's own origin or one of ``--allow_origin``;
* with ``--api_key``, every request but the chat page's own files carries ``Authorization: Bearer KEY``.
  A browser cannot set that header on a WebSocket, so ``/api/v2/generate`` may take the key in its
  first message instead (``{"type": "open_inference_session", "api_key": KEY, ...}``), checked by the
  route with ``key_check`` (never in the URL, which logs and histories keep).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from petals.api.errors import APIError, send_error

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
PUBLIC_PATHS = {"/", "/favicon.ico"}  # the chat page: it asks for the key itself
KEY_IN_FIRST_MESSAGE = {"/api/v2/generate"}  # WebSockets that read the key from their first message
KEY_CHECK = "petals.api_key_check"  # scope key: the route still has to check the key (a callable)


class Guard:
    """The allowed Host names and origins, and the API key; see the module docstring."""

    def __init__(
        self,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        allow_hosts: Iterable[str] = (),
        allow_origins: Iterable[str] = (),
    ) -> None:
        self.api_key = api_key.encode() if api_key else None
        self.hosts = {name.lower().strip("[]") for name in (host, *allow_hosts)}
        self.origins = {origin.lower().rstrip("/") for origin in allow_origins}

    def host_allowed(self, host: str) -> bool:
        name = _host_name(host)
        return (
            _is_ip_address(name) or name == "localhost" or name.endswith(".localhost") or name in self.hosts
        )

    def origin_allowed(self, origin: str, host: str) -> bool:
        """Same origin (the page's host and port are the ones the request was sent to) or allowed."""
        origin = origin.lower().rstrip("/")
        parts = urlsplit(origin)
        same = parts.scheme in ("http", "https") and parts.netloc == host.lower()
        return same or origin in self.origins

    def key_matches(self, given: str | bytes | None) -> bool:
        """In constant time: whether ``given`` is the API key (any value is, when there is no key)."""
        if self.api_key is None:
            return True
        if isinstance(given, str):
            given = given.encode()
        return isinstance(given, bytes) and hmac.compare_digest(given, self.api_key)


class GuardMiddleware:
    """Refuses what ``guard`` does not allow before any route sees it: 403 (HTTP) or a closed WebSocket."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app, self.guard = app, guard

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if host and not self.guard.host_allowed(host):
            message = f"the Host {host[:100]!r} is not served here (petals api --allow_host)"
            return await _refuse(scope, send, 403, message, "host_not_allowed")
        if origin is not None and not self.guard.origin_allowed(origin.decode("latin-1"), host):
            page = origin.decode("latin-1")
            message = f"pages from {page[:100]!r} may not use this API (petals api --allow_origin)"
            return await _refuse(scope, send, 403, message, "origin_not_allowed")
        if self.guard.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            authorization = headers.get(b"authorization", b"")
            bearer = authorization[len(b"Bearer ") :] if authorization.startswith(b"Bearer ") else None
            if not self.guard.key_matches(bearer):
                if scope["type"] == "websocket" and scope["path"] in KEY_IN_FIRST_MESSAGE:
                    scope = {**scope, KEY_CHECK: self.guard.key_matches}
                else:
                    message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                    return await _refuse(scope, send, 401, message, "invalid_api_key")
        await self.app(scope, receive, send)


async def _refuse(scope: dict, send: Callable, status: int, message: str, code: str) -> None:
    if scope["type"] == "websocket":  # before the handshake is accepted: the client sees HTTP 403
        await send({"type": "websocket.close", "code": 1008, "reason": code})
        return
    kind = "authentication_error" if status == 401 else "permission_error"
    await send_error(send, APIError(status, message, type=kind, code=code))


def _host_name(host: str) -> str:
    """``host`` of a Host header without its port (``[::1]:8000`` -> ``::1``), lowercased."""
    host = host.lower().strip()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
