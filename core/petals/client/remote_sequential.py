"""``RemoteSequential``: all of a model's transformer blocks, computed by the swarm.

Outside an inference session, ``forward`` is differentiable (``rpc_forward`` / ``rpc_backward``);
inside ``with blocks.inference_session(max_length=...)`` it steps the session (``rpc_inference``).

Thread-safe: the active session belongs to the thread that opened it, so one model serves many
threads at once (a web app's request handlers, say), each with its own sessions; the network loop,
routes and bans are shared.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from petals.client.inference_session import InferenceSession
from petals.client.routing import RemoteSequenceManager
from petals.client.sequential_autograd import RemoteChainFunction
from petals.network.client import ClientNetwork, network_options


class RemoteSequential(nn.Module):
    def __init__(self, config, *, network: ClientNetwork | None = None) -> None:
        super().__init__()
        self.config = config
        self.network = network if network is not None else ClientNetwork(network_options(config))
        self.manager = RemoteSequenceManager(config, self.network, config.num_hidden_layers)
        self._thread_state = threading.local()

    @property
    def active_session(self) -> InferenceSession | None:
        """The session that ``forward`` steps in the calling thread."""
        return getattr(self._thread_state, "session", None)

    @active_session.setter
    def active_session(self, session: InferenceSession | None) -> None:
        self._thread_state.session = session

    def __len__(self) -> int:
        return len(self.manager)

    @property
    def position(self) -> int:
        return self.active_session.position if self.active_session is not None else 0

    def forward(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        if self.active_session is not None:
            return self.active_session.step(hidden, prompts)
        empty = torch.empty(0, dtype=hidden.dtype, device=hidden.device)
        return RemoteChainFunction.apply(hidden, prompts if prompts is not None else empty, self.manager)

    @contextlib.contextmanager
    def inference_session(self, max_length: int, keep: bool = False) -> Iterator[InferenceSession]:
        """Open a session for up to ``max_length`` positions; the module's forward steps it meanwhile.
        ``keep``: its servers keep it when the block ends (``InferenceSession.close``)."""
        with self.use_session(InferenceSession(self.manager, max_length, keep)) as session:
            yield session

    @contextlib.contextmanager
    def use_session(self, session: InferenceSession) -> Iterator[InferenceSession]:
        if self.active_session is not None:
            raise RuntimeError("an inference session is already active on these blocks; close it first")
        self.active_session = session
        try:
            with session:
                yield session
        finally:
            self.active_session = None
