"""Petals' wire format: tensors, MessagePack metadata and ``args_structure``, checked on the way in.

Servers and clients share these helpers. Everything read from the network goes through
``read_metadata`` (MessagePack with hivemind's ext types only: tuples and tensor descriptors;
nothing is ever unpickled) and ``deserialize_tensor`` (dtype, codec and byte count checked before
numpy sees the buffer). A malformed message raises ``WireError`` (``petals.wire_errors``, with the other
kinds of refusal), whose text goes back to the peer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import torch
from hivemind.compression import NoCompression, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from petals.bounded_msgpack import check_msgpack
from petals.wire_errors import WireError, shown

MAX_UNARY_PAYLOAD_SIZE = (
    2 * 1024**2
)  # Petals streams larger payloads (the daemon caps unary messages at 4 MiB)
STREAM_CHUNK_SIZE = 2 * 1024**2
MAX_STREAM_PART_BYTES = 4 * 1024**2  # the original Petals splits streams into parts of this size
TENSOR_MARKER = b"__T"
NONE = runtime_pb2.CompressionType.NONE

# dtypes a peer may send; anything else (e.g. numpy "object") is refused before numpy parses the buffer
WIRE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}
# the 8-bit codecs of hivemind 1.1.12 are broken with numpy 2, so only these are accepted
WIRE_COMPRESSIONS = {
    runtime_pb2.CompressionType.NONE,
    runtime_pb2.CompressionType.FLOAT16,
    runtime_pb2.CompressionType.MEANSTD_16BIT,
}


def deserialize_tensor(proto: runtime_pb2.Tensor) -> torch.Tensor:
    """A tensor from the network, or ``WireError`` if its dtype, codec or size do not add up."""
    dtype = WIRE_DTYPES.get(proto.dtype)
    if dtype is None:
        raise WireError(f"unsupported tensor dtype {proto.dtype!r}; expected one of {sorted(WIRE_DTYPES)}")
    if proto.compression not in WIRE_COMPRESSIONS:
        raise WireError(f"unsupported tensor compression {proto.compression}")
    numel = 1
    for dim in proto.size:
        numel *= dim
    if proto.compression == NONE:
        itemsizes = (2, 4) if dtype == torch.bfloat16 else (dtype.itemsize,)  # bf16 may come as legacy fp32
        if len(proto.buffer) not in {numel * size for size in itemsizes}:
            raise WireError(
                f"tensor of shape {list(proto.size)} and dtype {proto.dtype} needs {numel * dtype.itemsize} bytes, "
                f"got {len(proto.buffer)}"
            )
    if proto.compression == NONE and dtype != torch.bfloat16:
        return _decode_uncompressed(proto, dtype, numel)
    try:
        return deserialize_torch_tensor(proto)
    except Exception as error:  # a codec choking on a malformed buffer
        raise WireError(f"cannot decode tensor of shape {list(proto.size)}: {error}") from error


def _decode_uncompressed(proto: runtime_pb2.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """What hivemind's codec returns for an uncompressed tensor, made straight from the buffer (no numpy
    array, no codec looked up by name); the traced decode step of ``benchmarks.generation_latency``
    shows the (de)serialization time."""
    shape = tuple(proto.size)
    if numel == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:  # a writable copy, as hivemind makes: the tensor outlives the message
        tensor = torch.frombuffer(bytearray(proto.buffer), dtype=dtype).reshape(shape)
    return tensor.requires_grad_(proto.requires_grad)


def deserialize_tensors(protos: Iterable[runtime_pb2.Tensor]) -> list[torch.Tensor]:
    return [deserialize_tensor(proto) for proto in protos]


_UNCOMPRESSED = NoCompression()


def serialize_tensor(tensor: torch.Tensor, compression: int = NONE) -> runtime_pb2.Tensor:
    tensor = tensor.detach().cpu()
    if compression == NONE:
        # the same message as serialize_torch_tensor, without the tensor descriptor it builds for
        # codecs that need one, which every decode step would pay for (benchmarks.generation_latency's
        # traced decode step shows the serialization time)
        return _UNCOMPRESSED.compress(tensor, None)
    return serialize_torch_tensor(tensor, compression)


def combine_tensor_parts(parts: Iterable[runtime_pb2.Tensor]) -> list[torch.Tensor]:
    """Tensors sent split for streaming: a part with a dtype starts a new tensor."""
    tensors, current = [], []
    for part in parts:
        if part.dtype and current:
            tensors.append(_combine(current))
            current = []
        if not current and not part.dtype:
            raise WireError("a streamed tensor part arrived before the part that describes the tensor")
        current.append(part)
    if current:
        tensors.append(_combine(current))
    return tensors


def _combine(parts: list[runtime_pb2.Tensor]) -> torch.Tensor:
    if parts[0].chunks and len(parts) != parts[0].chunks:
        raise WireError(f"a streamed tensor announced {parts[0].chunks} parts but {len(parts)} arrived")
    return deserialize_tensor(combine_from_streaming(parts) if len(parts) > 1 else parts[0])


def split_tensor(proto: runtime_pb2.Tensor, chunk_size: int = STREAM_CHUNK_SIZE) -> list[runtime_pb2.Tensor]:
    return list(split_for_streaming(proto, chunk_size))


async def read_stream(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], max_bytes: int
) -> tuple[str, dict[str, Any], list[torch.Tensor]]:
    """A request sent in parts (``rpc_*_stream``): uid and metadata from the first part, all tensors.

    Refused as soon as the tensors it declares, or the bytes that arrived, exceed ``max_bytes``:
    nothing more is read from the peer.
    """
    uid, metadata, parts = None, b"", []
    declared = received = 0
    async for request in requests:
        if uid is None:
            uid, metadata = request.uid, request.metadata
        for part in request.tensors:
            declared += _declared_bytes(part)
            received += len(part.buffer)
            if max(declared, received) > max_bytes:
                raise WireError(
                    f"the request carries more than {max_bytes} bytes of tensors, the most this server "
                    "accepts for one request (see its --max_batch_size); split it"
                )
        parts.extend(request.tensors)
    if uid is None:
        raise WireError("the request stream was empty")
    return uid, read_metadata(metadata), combine_tensor_parts(parts)


def _declared_bytes(part: runtime_pb2.Tensor) -> int:
    """What the first part of a streamed tensor announces (later parts announce nothing)."""
    if not part.dtype:
        return 0
    numel = 1
    for dim in part.size:
        numel *= dim
    dtype = WIRE_DTYPES.get(part.dtype)
    return numel * (dtype.itemsize if dtype is not None else 1)


class MessageTooLarge(WireError):
    """A stream message whose length header exceeds the limit; the stream is closed unread."""


def response_parts(tensors: Sequence[runtime_pb2.Tensor]) -> list[runtime_pb2.ExpertResponse]:
    """A response split into ``ExpertResponse`` messages of at most ``STREAM_CHUNK_SIZE`` bytes each."""
    return [runtime_pb2.ExpertResponse(tensors=[part]) for proto in tensors for part in split_tensor(proto)]


def request_parts(
    uid: str, tensors: Sequence[runtime_pb2.Tensor], metadata: bytes
) -> list[runtime_pb2.ExpertRequest]:
    """A request split for ``rpc_*_stream``: every part carries the uid and metadata, as Petals sends them."""
    return [
        runtime_pb2.ExpertRequest(uid=uid, tensors=[part], metadata=metadata)
        for proto in tensors
        for part in split_tensor(proto)
    ]


def read_metadata(raw: bytes) -> dict[str, Any]:
    """The MessagePack metadata dict of a request (empty bytes → ``{}``), with known keys type-checked."""
    if not raw:
        return {}
    try:
        check_msgpack(raw)
        metadata = MSGPackSerializer.loads(raw)
    except Exception as error:
        raise WireError(f"request metadata is not valid MessagePack: {error}") from error
    if not isinstance(metadata, dict) or not all(isinstance(key, str) for key in metadata):
        raise WireError(f"request metadata must be a dict with str keys, got {type(metadata).__name__}")
    for key, value in metadata.items():
        check = _METADATA_CHECKS.get(key)
        if check is not None and value is not None and not check(value):
            raise WireError(f"request metadata field {shown(key)} has an invalid value: {shown(value)}")
    return metadata


def write_metadata(metadata: dict[str, Any]) -> bytes:
    return MSGPackSerializer.dumps(metadata)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_next_server(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) == 4
        and isinstance(value[0], str)
        and isinstance(value[1], str)
        and _is_int(value[2])
        and _is_int(value[3])
    )


_METADATA_CHECKS = {
    "session_id": lambda v: isinstance(v, str),
    "step_id": lambda v: isinstance(v, str),
    "max_length": lambda v: _is_int(v) and v >= 0,
    "alloc_timeout": lambda v: _is_number(v) and v >= 0,
    "points": _is_number,
    "active_adapter": lambda v: isinstance(v, str),
    "start_from_position": lambda v: _is_int(v) and v >= 0,
    "next_servers": lambda v: isinstance(v, list | tuple) and all(_is_next_server(item) for item in v),
    "pushed": lambda v: isinstance(v, bool),
    "trace": lambda v: isinstance(v, bool),
    "output_compression": lambda v: isinstance(v, list | tuple) and all(c in WIRE_COMPRESSIONS for c in v),
    # petals-core extensions (``petals.server.validation`` checks them in full): keep a session when it
    # ends, under a key; continue a kept one
    "keep": lambda v: isinstance(v, str),
    "resume": lambda v: isinstance(v, dict),
}


def pack_args_kwargs(*args: torch.Tensor) -> tuple[list[torch.Tensor], tuple]:
    """Positional tensors → (flat tensors, ``args_structure``) with ``b"__T<i>"`` markers, as Petals sends."""
    return list(args), (tuple(TENSOR_MARKER + str(index).encode() for index in range(len(args))), {})


def unpack_args(tensors: list[torch.Tensor], args_structure: Any) -> list[torch.Tensor]:
    """The positional tensors an ``args_structure`` names (absent structure: the flat list as sent)."""
    if args_structure is None:
        return tensors
    if not (isinstance(args_structure, list | tuple) and len(args_structure) == 2):
        raise WireError("args_structure must be (args, kwargs)")
    args, kwargs = args_structure
    if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
        raise WireError("args_structure must be (args tuple, kwargs dict)")
    if kwargs:
        raise WireError(f"this server takes no keyword tensors, got {sorted(map(str, kwargs))}")
    return [_resolve_marker(tensors, marker) for marker in args]


def _resolve_marker(tensors: list[torch.Tensor], marker: Any) -> torch.Tensor:
    if not (isinstance(marker, bytes) and marker.startswith(TENSOR_MARKER) and marker[3:].isdigit()):
        raise WireError(f"args_structure entries must be tensor markers like b'__T0', got {marker!r}")
    index = int(marker[3:])
    if index >= len(tensors):
        raise WireError(f"args_structure names tensor {index} but only {len(tensors)} were sent")
    return tensors[index]


def is_dummy(tensor: torch.Tensor) -> bool:
    """Petals' placeholder for "no tensor here" (no prompts, no hypo_ids): an empty tensor."""
    return tensor.numel() == 0


def block_schemas(hidden_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """The per-block part of ``rpc_info``: the tensor schemas Petals servers describe their blocks with."""
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    hidden = BatchTensorDescriptor(1, 2048, hidden_size, dtype=dtype, compression=NONE)
    inference = (hidden, BatchTensorDescriptor((), dtype=dtype), BatchTensorDescriptor((), dtype=torch.int64))
    return {
        "forward_schema": ((hidden,), {}),
        "outputs_schema": (hidden,),
        "keyword_names": (),
        "inference_schema": (inference, {}),
    }
