"""Open inference sessions: their caches, position and inbox, found by session id for ``rpc_push``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from hivemind.proto import runtime_pb2

from petals.kv_cache import BlockCache
from petals.server.backend import BlockBackend


@dataclass
class InferenceSession:
    """One client's stream on this server: a KV cache per block, fed by its client and by pushes."""

    session_id: str
    backends: list[BlockBackend]
    caches: list[BlockCache]
    batch_size: int
    max_length: int
    inbox: asyncio.Queue[runtime_pb2.ExpertRequest | None] = field(default_factory=asyncio.Queue)
    done_steps: set[str] = field(default_factory=set)

    @property
    def position(self) -> int:
        return self.caches[0].position

    def close(self) -> None:
        """Ask the session's loop to finish (the loop frees the caches)."""
        self.inbox.put_nowait(None)


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[str, InferenceSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: object) -> InferenceSession | None:
        return self._sessions.get(session_id) if isinstance(session_id, str) else None

    @contextmanager
    def registered(self, session: InferenceSession) -> Iterator[InferenceSession]:
        if session.session_id in self._sessions:
            raise ValueError(f"session {session.session_id!r} is already open on this server")
        self._sessions[session.session_id] = session
        try:
            yield session
        finally:
            del self._sessions[session.session_id]
            session.caches.clear()

    def close_all(self) -> None:
        for session in list(self._sessions.values()):
            session.close()
