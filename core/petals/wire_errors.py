"""The wire's words: the errors a server sends back, each tagged with its kind, and peers' strings cut for logs.

Apart from ``petals.wire`` so that peers that never touch a tensor (``petals dht``, ``monitor``, ``health``)
and the private swarm's membership checks use them without importing torch.
"""

from __future__ import annotations

import re
from typing import Any


class WireError(ValueError):
    """A request that does not follow the protocol; the message is sent back to the peer."""

    kind = "bad_request"


class NotServedError(WireError):
    """The request names blocks this server does not (or no longer) serve."""

    kind = "not_served"


class UnauthorizedError(WireError):
    """A private swarm's server refuses a caller that is not a member (``petals.membership``)."""

    kind = "unauthorized"


# What a refusal means to a client, sent as a "[kind] " prefix of the error text (the only field of
# hivemind's RPCError; a stock Petals client just shows the text):
ERROR_KINDS = {
    "bad_request": "the request itself is wrong: retrying it anywhere fails the same way",
    "not_served": "this server does not serve those blocks (any more): route again",
    "cache_full": "no KV cache left for the session here: another server may have some",
    # the session's pages went to an older session (or, while it was idle, to any): not the server's fault
    "preempted": "the server gave this session's pages to another session: replay its history, here or elsewhere",
    "timeout": "the server gave up waiting (for the client or its compute queue)",
    "internal": "the server failed while computing: another server may not",
    "unauthorized": "a private swarm's server serves only members: the caller presented no valid certificate",
}
_KIND_PATTERN = re.compile(r"\[(" + "|".join(ERROR_KINDS) + r")\] ")


def tag_error(kind: str, text: str) -> str:
    return f"[{kind}] {text}"


def error_kind(text: str) -> str | None:
    """The kind a server of ours tagged its error text with (None from other servers)."""
    match = _KIND_PATTERN.search(text)
    return match.group(1) if match else None


def cut(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters: peers choose these strings, and logs must stay small."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(value: Any, limit: int = 80) -> str:
    return cut(repr(value), limit)
