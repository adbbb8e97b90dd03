"""A minimal synchronous client speaking Petals' wire protocol over raw hivemind calls.

For tests and diagnostics: it talks to servers exactly as a stock Petals client does
(``ExpertRequest`` / ``ExpertResponse``, MessagePack metadata, ``args_structure``), with none of the
routing or retries of the real client. It owns a ``P2P`` and a client-mode ``DHTNode`` in an event
loop running on a background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from petals.constants import CHAIN_DELIMITER
from petals.data_structures import RemoteModuleInfo
from petals.dht import create_node, get_remote_module_infos
from petals.membership import load_membership
from petals.network.client import leave_swarm, stop_event_loop
from petals.network.p2p import LOOPBACK_MADDRS, NetworkOptions
from petals.wire import deserialize_tensors, pack_args_kwargs, read_metadata, serialize_tensor, write_metadata

T = TypeVar("T")
HANDLER = "TransformerConnectionHandler"
EMPTY = torch.empty(0)


class WireClient:
    """``identity_path``, ``swarm_authority``, ``membership``: a peer of a private swarm (``petals.membership``),
    which signs what it stores and presents its certificate to servers."""

    def __init__(
        self, initial_peers: Sequence[str], timeout: float = 60, **private_swarm: str | None
    ) -> None:
        self.timeout = timeout
        network = NetworkOptions(
            initial_peers=initial_peers,
            host_maddrs=LOOPBACK_MADDRS,
            nat_port_map=False,
            auto_nat=False,
            use_relay=False,
            **private_swarm,
        )
        self.membership = load_membership(network, certificate_required=False)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="wire-client", daemon=True)
        self._thread.start()
        self.p2p: P2P = self.run(network.create_p2p())
        self.node: DHTNode = self.run(create_node(self.p2p, initial_peers, self.membership, client_mode=True))
        if self.membership is not None:
            self.run(self.membership.present_certificate(self.p2p))

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout or self.timeout)

    def close(self) -> None:
        stop_event_loop(self.loop, self._thread, leave_swarm(self.node, self.p2p))

    # ---- DHT -----------------------------------------------------------------------------------

    def module_infos(self, uids: Sequence[str]) -> list[RemoteModuleInfo]:
        return self.run(get_remote_module_infos(self.node, uids, latest=True))

    def dht_get(self, key: str) -> Any:
        return self.run(self.node.get(key, latest=True))

    # ---- unary and streamed calls --------------------------------------------------------------

    def info(self, peer: str, uid: str = "") -> dict:
        response = self.run(
            self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer),
                f"{HANDLER}.rpc_info",
                runtime_pb2.ExpertUID(uid=uid),
                runtime_pb2.ExpertInfo,
            )
        )
        return MSGPackSerializer.loads(response.serialized_info)

    def call(self, peer: str, method: str, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        """A raw unary call (``rpc_forward``, ``rpc_backward``, ``rpc_push``)."""
        return self.run(
            self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer), f"{HANDLER}.{method}", request, runtime_pb2.ExpertResponse
            )
        )

    def call_stream(
        self, peer: str, method: str, requests: Sequence[runtime_pb2.ExpertRequest]
    ) -> list[runtime_pb2.ExpertResponse]:
        async def call() -> list[runtime_pb2.ExpertResponse]:
            responses = await self.p2p.iterate_protobuf_handler(
                PeerID.from_base58(peer), f"{HANDLER}.{method}", _aiter(requests), runtime_pb2.ExpertResponse
            )
            return [response async for response in responses]

        return self.run(call())

    def forward(
        self, peer: str, uids: Sequence[str], hidden: torch.Tensor, prompts: torch.Tensor = EMPTY
    ) -> torch.Tensor:
        request = make_request(uids, [hidden, prompts], {})
        return deserialize_tensors(self.call(peer, "rpc_forward", request).tensors)[0]

    def backward(
        self,
        peer: str,
        uids: Sequence[str],
        hidden: torch.Tensor,
        grad: torch.Tensor,
        prompts: torch.Tensor = EMPTY,
    ) -> list[torch.Tensor]:
        request = make_request(uids, [hidden, grad, prompts], {})
        return deserialize_tensors(self.call(peer, "rpc_backward", request).tensors)

    def inference(self, peer: str, uids: Sequence[str], max_length: int, **metadata: Any) -> InferenceStream:
        return InferenceStream(self, peer, uids, max_length, metadata)


class InferenceStream:
    """One ``rpc_inference`` stream: ``step(hidden)`` sends a step and returns the server's output (and
    keeps the metadata the server answered with in ``reply``)."""

    def __init__(
        self, client: WireClient, peer: str, uids: Sequence[str], max_length: int, metadata: dict
    ) -> None:
        self.client, self.uids = client, list(uids)
        self.session_id = metadata.pop("session_id", str(uuid.uuid4()))
        self.first_metadata = {"max_length": max_length, "session_id": self.session_id, **metadata}
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses = client.run(self._open(peer))
        self.steps = 0
        self.reply: dict = {}  # the last response's metadata

    async def _open(self, peer: str):
        async def requests():
            while (request := await self._requests.get()) is not None:
                yield request

        return await self.client.p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer), f"{HANDLER}.rpc_inference", requests(), runtime_pb2.ExpertResponse
        )

    def send(self, request: runtime_pb2.ExpertRequest) -> torch.Tensor:
        """Send a raw request and return the response's tensor."""

        async def exchange() -> runtime_pb2.ExpertResponse:
            await self._requests.put(request)
            return await anext(self._responses)

        self.steps += 1
        response = self.client.run(exchange())
        self.reply = read_metadata(response.metadata) if response.metadata else {}
        return deserialize_tensors(response.tensors)[0]

    def post(self, request: runtime_pb2.ExpertRequest) -> None:
        """Send a raw request without waiting for a response (e.g. one the server should drop)."""
        self.client.run(self._requests.put(request))

    def step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor = EMPTY,
        hypo_ids: torch.Tensor | None = None,
        **metadata: Any,
    ) -> torch.Tensor:
        hypo_ids = torch.empty(0, dtype=torch.int64) if hypo_ids is None else hypo_ids
        metadata = {
            **(self.first_metadata if self.steps == 0 else {"session_id": self.session_id}),
            **metadata,
        }
        metadata.setdefault("step_id", str(uuid.uuid4()))
        return self.send(make_request(self.uids, [hidden, prompts, hypo_ids], metadata))

    def close(self, **metadata: Any) -> None:
        """End the session with an empty request (carrying ``metadata``: ``keep=key`` keeps it)."""
        closing = runtime_pb2.ExpertRequest(metadata=write_metadata(metadata) if metadata else b"")

        async def finish() -> None:
            await self._requests.put(closing)  # an empty request ends the session
            await self._requests.put(None)
            with contextlib.suppress(ConnectionError):  # the server may close the stream first
                async for _ in self._responses:
                    pass

        self.client.run(finish())


def make_request(
    uids: Sequence[str], tensors: Sequence[torch.Tensor], metadata: dict
) -> runtime_pb2.ExpertRequest:
    flat, structure = pack_args_kwargs(*tensors)
    return runtime_pb2.ExpertRequest(
        uid=CHAIN_DELIMITER.join(uids),
        tensors=[serialize_tensor(tensor) for tensor in flat],
        metadata=write_metadata({"args_structure": structure, **metadata}),
    )


async def _aiter(items):
    for item in items:
        yield item
