"""How a failed request reaches the peer: tagged with its kind, logged once, never as a traceback.

A refusal (a malformed request, blocks not served, no KV cache left, a session preempted, a timeout) is the peer's
problem or a passing state: one INFO line here, and ``[kind] text`` for the peer (``wire_errors.ERROR_KINDS``),
so our clients know whether to retry elsewhere. Anything else is our failure: logged with its
traceback, and sent as ``[internal]``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from hivemind.p2p import P2PContext, PeerID

from petals.kv_cache import OutOfPagesError, SessionPreempted
from petals.membership import AdmissionGuard, admitted
from petals.server.cache_budget import AllocationFailed
from petals.server.metrics import NoMetrics
from petals.wire_errors import WireError, cut, tag_error

logger = logging.getLogger("petals.server.handler")


@asynccontextmanager
async def reporting(
    method: str, context: P2PContext, metrics: NoMetrics, admission: AdmissionGuard | None = None
) -> AsyncIterator[None]:
    """Log each failure of an RPC once, and send it to the peer tagged with its kind. In a private
    swarm, ``admission`` first refuses callers that are not members, before anything is decoded."""
    metrics.request_started(method)
    try:
        async with admitted(admission, context.remote_id, method):
            yield
    except REFUSALS as error:
        metrics.request_failed(method, _kind(error))
        logger.info("%s from %s refused: %s", method, _short(context.remote_id), cut(str(error)))
        raise Refusal(tag_error(_kind(error), cut(str(error), 2000))) from None
    except Exception as error:
        metrics.request_failed(method, "internal")
        logger.exception("%s from %s failed", method, _short(context.remote_id))
        raise Refusal(tag_error("internal", cut(str(error), 2000))) from None


class Refusal(Exception):
    """What the peer receives: the error text with its kind in front."""


def _kind(error: BaseException) -> str:
    if isinstance(error, SessionPreempted):  # before OutOfPagesError, which it is
        return error.kind
    if isinstance(error, AllocationFailed | OutOfPagesError):
        return "cache_full"
    if isinstance(error, TimeoutError):
        return "timeout"
    return error.kind


REFUSALS = (WireError, AllocationFailed, OutOfPagesError, TimeoutError)
QUIET = (*REFUSALS, Refusal)


def _quiet_refusals(record: logging.LogRecord) -> bool:
    """hivemind logs every exception of a stream handler as a WARN traceback; refusals are a peer's
    mistake, already logged once (by ``_reporting`` or ``limit_inbound_message_size``), so drop those records."""
    return not (record.exc_info and isinstance(record.exc_info[1], QUIET))


def quiet_hivemind_refusals() -> None:
    """Keep hivemind from logging our refusals again, as tracebacks (once per process)."""
    hivemind_logger = logging.getLogger("hivemind.p2p.p2p_daemon")
    if _quiet_refusals not in hivemind_logger.filters:
        hivemind_logger.addFilter(_quiet_refusals)


def _short(peer_id: PeerID) -> str:
    return str(peer_id)[-6:]
