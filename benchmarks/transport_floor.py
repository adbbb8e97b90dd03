"""(g) The transport floor: what one message costs between two hivemind peers on this machine.

    python -m benchmarks.transport_floor [--quick]

An echo peer runs in a separate process (``python -m benchmarks.transport_floor --echo-peer``); this
process sends it the request of one decode step (the tiny Llama's hidden state ``[1, 1, 256]`` with
empty prompts and hypo_ids and a client's metadata, exactly as ``InferenceSession`` sends it) and
times the round trip of the echoed reply: inside one open stream (what an inference session pays
per server and step) and as a unary call, with a plain asyncio TCP echo for scale. The latency
benchmarks divide their overhead by this floor, measured in the same run.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch

from benchmarks.harness import TINY_LLAMA, Context, Result, main

LOOPBACK = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)
STREAM, UNARY = "echo_stream", "echo_unary"


def decode_step_request(hidden_size: int):
    """The ``ExpertRequest`` an inference session sends a server for one new token."""
    from hivemind.proto import runtime_pb2

    from petals.wire import pack_args_kwargs, serialize_tensor, write_metadata

    tensors, structure = pack_args_kwargs(
        torch.randn(1, 1, hidden_size), torch.empty(0), torch.empty(0, dtype=torch.int64)
    )
    metadata = {"session_id": str(uuid.uuid4()), "step_id": str(uuid.uuid4()), "args_structure": structure}
    return runtime_pb2.ExpertRequest(
        uid="model.0 model.1 model.2 model.3",
        tensors=[serialize_tensor(tensor) for tensor in tensors],
        metadata=write_metadata(metadata),
    )


# ---- the echo peer (its own process) -------------------------------------------------------------


async def serve_echo() -> None:
    """Echo every request's tensors back, unary and in streams; print our address and TCP port."""
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    async def unary(request, context):
        return runtime_pb2.ExpertResponse(tensors=request.tensors)

    async def stream(requests, context) -> AsyncIterator:
        async for request in requests:
            yield runtime_pb2.ExpertResponse(tensors=request.tensors)

    async def tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    p2p = await P2P.create(**LOOPBACK)
    await p2p.add_protobuf_handler(UNARY, unary, runtime_pb2.ExpertRequest)
    await p2p.add_protobuf_handler(
        STREAM, stream, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
    )
    tcp = await asyncio.start_server(tcp_echo, "127.0.0.1", 0)
    maddrs = await p2p.get_visible_maddrs()
    print(maddrs[0], tcp.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until our parent closes stdin
    await p2p.shutdown()


# ---- the measuring side --------------------------------------------------------------------------


async def measure(maddr: str, tcp_port: int, hidden_size: int, rounds: int) -> dict[str, list[float]]:
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import runtime_pb2

    request = decode_step_request(hidden_size)
    peer_id = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
    p2p = await P2P.create(initial_peers=[maddr], **LOOPBACK)
    samples: dict[str, list[float]] = {"stream": [], "unary": [], "tcp": []}
    try:
        requests: asyncio.Queue = asyncio.Queue()

        async def outgoing():
            while (item := await requests.get()) is not None:
                yield item

        responses = await p2p.iterate_protobuf_handler(
            peer_id, STREAM, outgoing(), runtime_pb2.ExpertResponse
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        payload = request.SerializeToString()
        for index in range(rounds + 5):  # the first rounds warm up connections and caches
            started = time.perf_counter()
            requests.put_nowait(request)
            await anext(responses)
            stream_seconds = time.perf_counter() - started

            started = time.perf_counter()
            await p2p.call_protobuf_handler(peer_id, UNARY, request, runtime_pb2.ExpertResponse)
            unary_seconds = time.perf_counter() - started

            started = time.perf_counter()
            writer.write(payload)
            await reader.readexactly(len(payload))
            tcp_seconds = time.perf_counter() - started
            if index >= 5:
                samples["stream"].append(stream_seconds)
                samples["unary"].append(unary_seconds)
                samples["tcp"].append(tcp_seconds)
        requests.put_nowait(None)
        writer.close()
    finally:
        await p2p.shutdown()
    return samples


def measure_floor(ctx: Context) -> dict[str, Any]:
    """Round trips (seconds) of one decode step's message; measured once per run, shared via ``ctx``."""
    if "transport_floor" in ctx.shared:
        return ctx.shared["transport_floor"]
    hidden_size, rounds = ctx.pick((TINY_LLAMA.hidden_size, 300), (64, 20))
    peer = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.transport_floor", "--echo-peer"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        maddr, tcp_port = peer.stdout.readline().split()
        samples = asyncio.run(measure(maddr, int(tcp_port), hidden_size, rounds))
    finally:
        peer.stdin.close()
        try:
            peer.wait(15)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    floor = {
        name: {"median": statistics.median(values), "best": min(values), "samples": values}
        for name, values in samples.items()
    }
    floor["payload_bytes"] = len(decode_step_request(hidden_size).SerializeToString())
    ctx.shared["transport_floor"] = floor
    return floor


def transport_floor(ctx: Context) -> Result:
    floor = measure_floor(ctx)
    stream, unary, tcp = (floor[name]["median"] for name in ("stream", "unary", "tcp"))
    return Result(
        item="g",
        title="transport floor: one decode step's message between two hivemind peers (separate processes)",
        ratio=stream / tcp,
        baseline="plain asyncio TCP round trip of the same bytes",
        checks=[],
        measurements={"round_trip_seconds": floor},
        settings={"payload_bytes": floor["payload_bytes"], "rounds": len(floor["stream"]["samples"])},
        notes=[
            f"round trip, median of {len(floor['stream']['samples'])} ({floor['payload_bytes']} B request): "
            f"in an open stream {stream * 1e3:.3f} ms, unary call {unary * 1e3:.3f} ms, "
            f"plain asyncio TCP {tcp * 1e3:.3f} ms"
        ],
    )


BENCHMARKS = {"transport_floor": transport_floor}

if __name__ == "__main__":
    if sys.argv[1:] == ["--echo-peer"]:
        asyncio.run(serve_echo())
    else:
        sys.exit(main(BENCHMARKS))
