"""Sessions kept between generations, so that a conversation continues instead of starting over.

A chat client sends the whole conversation with every turn (an OpenAI client does). ``KeptSessions``
holds the inference sessions of recent generations, closed with ``keep``: their servers keep the keys
and values (their pages lent to any session that needs them meanwhile), and each session here keeps
what it sent them. A generation whose tokens share most of a kept session's tokens continues that
session from their longest common prefix: the session is rolled back to there (each server rewinds, or
is sent again what it cannot rewind to or no longer holds) and only the rest of the prompt is computed.

    chats = KeptSessions()
    reply = model.generate(conversation_ids, kept_sessions=chats, max_new_tokens=40)
    # next turn: conversation_ids + reply + the user's next message continue that session

Bounded by count (``max_sessions``: the least recently used are forgotten first) and idle time
(``idle_seconds``); a forgotten session stays on its servers only until they need its pages or their own
bounds end it. Servers keep sessions for the peer that closed them: a store serves one model (one p2p
identity). Sessions of one sequence (batch size 1) are kept; others are closed as usual.

A session continues another only where they share at least half of what it holds: a common beginning
(a chat template's first tokens, a shared system prompt) does not take another conversation's session.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from petals.client.inference_session import InferenceSession

MAX_SESSIONS = 8
IDLE_SECONDS = 300.0  # below the servers' own bound (petals.kv_cache.lending.KEPT_SECONDS)


@dataclass
class _Kept:
    session: InferenceSession
    tokens: list[int]  # what it generated so far (its servers hold all but, usually, the last one)
    last_used: float


class KeptSessions:
    """Inference sessions closed with ``keep``, keyed by their token ids; see the module docstring.
    Thread-safe: a web app's request threads share one."""

    def __init__(
        self,
        max_sessions: int = MAX_SESSIONS,
        idle_seconds: float = IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions, self.idle_seconds, self.clock = max_sessions, idle_seconds, clock
        self._kept: list[_Kept] = []  # least recently used first
        self._lock = threading.Lock()
        self.continued = 0  # sessions taken to continue a generation
        self.reused_tokens = 0  # positions those did not compute again

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._kept)

    def open(self, manager, ids: torch.Tensor | Sequence[int], max_length: int) -> InferenceSession:
        """A session for a generation of up to ``max_length`` positions from ``ids``: the kept one it
        continues, rolled back to where they differ and reopened, or a new one; closed with keep either
        way when its ``with`` block ends without an error (then ``put`` it back)."""
        session = self.take(ids)
        if session is None:
            return InferenceSession(manager, max_length, keep=True)
        session.reopen(max(max_length, session.position))
        session.keep = True
        return session

    def take(self, ids: torch.Tensor | Sequence[int]) -> InferenceSession | None:
        """The kept session sharing the longest prefix with ``ids`` (at least half of what it holds),
        removed from the store and rolled back to that prefix, less one token (a generation computes at
        least one); None if none qualifies."""
        tokens = _row(ids)
        if tokens is None or not tokens:
            return None
        with self._lock:
            self._expire()
            best, point = None, 0
            for kept in self._kept:
                held = kept.session.tokens
                shared = min(_common_prefix(tokens, kept.tokens), held, len(tokens) - 1)
                if shared > point and 2 * shared >= held:
                    best, point = kept, shared
            if best is None:
                return None
            self._kept.remove(best)
            self.continued += 1
            self.reused_tokens += point
        session = best.session
        session.rollback(point + session.prompt_length)
        return session

    def put(self, session: InferenceSession) -> None:
        """Keep ``session`` if it was closed with keep (one sequence); forget the least recently used
        beyond ``max_sessions``."""
        output = session.output_ids
        if not session.kept or output is None or output.shape[0] != 1:
            return
        with self._lock:
            self._kept.append(_Kept(session, output[0].tolist(), self.clock()))
            self._expire()
            del self._kept[: max(0, len(self._kept) - self.max_sessions)]

    def _expire(self) -> None:
        now = self.clock()
        self._kept = [kept for kept in self._kept if now - kept.last_used <= self.idle_seconds]


def _row(ids: torch.Tensor | Sequence[int] | None) -> list[int] | None:
    """The token ids of one sequence (None for a batch of several)."""
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        if ids.ndim == 2 and ids.shape[0] != 1:
            return None
        return ids.reshape(-1).tolist()
    return list(ids)


def _common_prefix(first: list[int], second: list[int]) -> int:
    """How many tokens ``first`` and ``second`` share from the start."""
    length = min(len(first), len(second))
    if length == 0:
        return 0
    differ = torch.tensor(first[:length]) != torch.tensor(second[:length])
    return int(differ.int().argmax()) if bool(differ.any()) else length
