"""Calls to a server's ``TransformerConnectionHandler`` RPCs, as a stock Petals client makes them.

Forward and backward requests go unary when their tensors fit in ``MAX_UNARY_PAYLOAD_SIZE`` and are
streamed in parts (``rpc_*_stream``) otherwise, because the p2p daemon caps unary messages at 4 MiB.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter

from petals.wire import (
    MAX_UNARY_PAYLOAD_SIZE,
    combine_tensor_parts,
    deserialize_tensors,
    request_parts,
    serialize_tensor,
    write_metadata,
)
from petals.wire_errors import WireError

HANDLER = "TransformerConnectionHandler"


def protocol(method: str) -> str:
    return f"{HANDLER}.{method}"


async def call_chain(
    p2p: P2P,
    peer_id: PeerID,
    method: str,
    uid: str,
    tensors: Sequence[torch.Tensor],
    metadata: dict[str, Any],
    timeout: float,
) -> list[torch.Tensor]:
    """``rpc_forward`` / ``rpc_backward`` on one server's span, streamed when the payload is large."""
    protos = [serialize_tensor(tensor) for tensor in tensors]
    raw_metadata = write_metadata(metadata)
    payload = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    if payload <= MAX_UNARY_PAYLOAD_SIZE:
        request = runtime_pb2.ExpertRequest(uid=uid, tensors=protos, metadata=raw_metadata)
        call = p2p.call_protobuf_handler(peer_id, protocol(method), request, runtime_pb2.ExpertResponse)
        response = await asyncio.wait_for(call, timeout)
        return deserialize_tensors(response.tensors)

    async def streamed() -> list[torch.Tensor]:
        parts = as_aiter(*request_parts(uid, protos, raw_metadata))
        responses = await p2p.iterate_protobuf_handler(
            peer_id, protocol(f"{method}_stream"), parts, runtime_pb2.ExpertResponse
        )
        answer = [part async for response in responses for part in response.tensors]
        # a stream closed early ends like a complete one (hivemind reads until the close): say so, as a
        # fault of the server's or the link's that another server may not have
        if not answer:
            raise EOFError(f"{method}_stream: the server closed the stream without an answer")
        try:
            return combine_tensor_parts(answer)
        except WireError as error:
            raise EOFError(f"{method}_stream: the answer was cut short: {error}") from error

    return await asyncio.wait_for(streamed(), timeout)


async def ping(p2p: P2P, peer_id: PeerID, timeout: float) -> float:
    """Round-trip time of an empty ``rpc_info`` (what the server answers fastest), or inf."""
    started = time.perf_counter()
    try:
        call = p2p.call_protobuf_handler(
            peer_id, protocol("rpc_info"), runtime_pb2.ExpertUID(), runtime_pb2.ExpertInfo
        )
        await asyncio.wait_for(call, timeout)
    except Exception:
        return float("inf")
    return time.perf_counter() - started


async def open_inference_stream(
    p2p: P2P, peer_id: PeerID, requests: AsyncIterator[runtime_pb2.ExpertRequest]
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    return await p2p.iterate_protobuf_handler(
        peer_id, protocol("rpc_inference"), requests, runtime_pb2.ExpertResponse
    )
