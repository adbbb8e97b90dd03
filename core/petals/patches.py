"""Every change petals makes to a third-party library, each checked against the shape of what it changes.

hivemind 1.1.12 offers no option for four things petals needs, so petals changes its behaviour:

* ``MSGPackSerializer.loads`` checks nesting depth and size first (``petals.bounded_msgpack``): the
  DHT decodes every key, subkey and value through this class attribute, and less than a kilobyte of
  nested tuples overflows the C stack of whoever decodes them;
* ``P2P.create`` starts p2pd in a session of its own (``p2pd_started_apart``), so that a signal to
  our process group reaches only the Python side, which can then still announce OFFLINE through
  the daemon (``petals.network.p2p``);
* a server's P2P refuses, unread, an inbound stream message longer than the server accepts
  (``limit_inbound_message_size``): hivemind reads a stream message whole, however long its header
  says it is, before a handler sees it. The same wrapper lets a stream that ended in an error close
  only after its caller has: p2pd resets a stream its handler closes, and the reset can overtake the
  error on its way to the caller;
* each message to the p2p daemon is written whole, in one ``write`` (``P2P.send_protobuf`` on streams,
  ``write_pbmsg`` for unary calls and the daemon's control): hivemind writes a stream message's marker,
  length and body, and a unary message's length byte by byte, in separate writes, and each write is a
  system call the daemon may wake up for and forward as a frame of its own. The bytes are the same.

Each is a ``Patch`` in ``PATCHES``: the attribute it replaces, the releases it was checked on, and its
shape: what the patch relies on in the code it changes (the attribute, function or signature it
replaces), checked where it is applied instead of a version. A release where the shape differs is left
alone, with one debug line saying what differs, and startup continues (``Patch.fits``); each patch's
test in ``tests/test_patches.py`` shows what it prevents, reproduced without it, so that one no longer
needed shows up there. The process-wide ones are applied once, by ``apply_patches``, where every entry
point creates its peer: ``NetworkOptions.create_p2p``, which server start, ``petals dht``, the client's
``from_pretrained`` and ``petals.testing`` all go through (so ``petals --help`` still imports
neither hivemind nor torch). Nothing else in petals assigns into a third-party module or class
(``tests/test_patches.py`` checks it).

Five more change only how a package is imported, so that a process imports what it uses (a server
starts with about 45 MiB less and 0.5 s sooner; docs/performance.md has the measurements):

* ``hivemind``'s ``__init__`` is not run. It imports every subsystem (averaging, which imports scipy;
  moe; optim) to export eleven names, and petals uses none of them; they are imported on first
  access instead (``hivemind.DHT`` and ``from hivemind import DHT`` still work). The same for
  ``hivemind.utils`` and ``hivemind.dht``: their ``__init__`` imported torch (``MPFuture``,
  ``TensorDescriptor``, the multiprocessing ``DHT``) for every module that wants a logger, so that peers
  holding no blocks (``petals dht``, ``monitor``, ``health``) now start without torch: a bootstrap peer is
  ready in 0.7 s instead of 2.6 s, with 34 MiB of PSS instead of 196 MiB besides its p2p daemon;
* ``torch._dynamo``'s ``__init__`` (the compiler: 25 MiB and 0.4 s after what transformers imports anyway)
  runs on the first access to one of its names or import of one of its submodules, as Python would run
  it, but not when transformers imports the one submodule it needs (``_trace_wrapped_higher_order_op``,
  from ``masking_utils``) or marks functions at import time with ``torch.compiler.disable``,
  ``allow_in_graph`` and ``torch._dynamo.assume_constant_result``. Until it runs, those three mark
  nothing: nothing can be compiling while the compiler is not imported. When it runs (``torch.compile``,
  any other name), the marks are applied as if made then, and a function ``disable`` wrapped calls
  through dynamo's own disabled wrapper from then on;
* ``scipy.optimize``'s ``__init__`` (20 MiB, 0.4 s) runs on first access too; ``linear_sum_assignment``,
  which transformers' object-detection losses import on every model import, comes from its own
  extension module without it.

``import petals`` installs them (``install_import_patches``: a finder ahead of Python's own that
touches only these packages, and none imported already). An import patch checks its package's shape
from its files, without importing it.

One more is for petals' own commands alone: ``petals serve``, ``chat``, ``generate``, ``tune``, ``api`` and
``demo`` first make transformers' ``is_torch_distributed_available`` answer False
(``without_torch_distributed``), so that transformers' loading code does not import DTensor and FSDP,
nor sympy through them (43 MiB and 0.8 s of a server's start), for process groups these processes never
create. A program that imports petals keeps transformers as it is.

And one lasts a ``with`` block: ``gguf_parsed_once``, around every read of a GGUF file's config, tokenizer and
weights through transformers (``petals.formats.gguf``), lets transformers parse the file once instead of three
times and build gguf's tensor name map once instead of once per module (34 s down to 14 s on two cores, the
same files written). Within it, transformers reads each element of a metadata array directly where gguf's
reader gives it as a numpy array (``GGUF_VALUES_SOONER``: 1.2 s less for Gemma 3's 262,144-token vocabulary).

And one overrides two private methods of gguf's reader, in a subclass of it that ``petals.formats.gguf``
parses files with (``gguf_reader``, ``GGUF_METADATA_IN_BULK``): each metadata array is read out of the file
at once instead of one element at a time through the memory map (Gemma 3's metadata: 24 s down to 0.5 s),
and a read past the end of the file says so instead of giving gguf a shorter array than it asked for.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import contextvars
import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    from hivemind.p2p import P2P

logger = logging.getLogger(__name__)


# what reading a shape raises where a module, a file or a name is gone or not what it was
_SHAPE_UNREADABLE = (ImportError, AttributeError, LookupError, OSError, SyntaxError, TypeError, ValueError)


@dataclass(frozen=True)
class Patch:
    target: str  # what it replaces, as "module:Qualified.name"
    checked_on: tuple[str, ...]  # the releases it was written and tested against, as "distribution version"
    reason: str
    shape: Callable[[], str | None]  # what differs from the code it was written against; None: nothing
    install: Callable[[], None] | None = None  # process-wide patches: apply_patches runs it once

    def fits(self) -> bool:
        """Whether what it patches has the shape it was written for; one debug line where not."""
        try:
            differs = self.shape()
        except _SHAPE_UNREADABLE as error:
            differs = f"{type(error).__name__}: {error}"
        if differs is not None:
            logger.debug(
                "Leaving %s unchanged (checked on %s): %s", self.target, ", ".join(self.checked_on), differs
            )
        return differs is None


def _signature(function: Callable) -> str:
    """``function``'s parameters as written, without annotations: ``(path, mode='r')``."""
    plain = inspect.signature(function)
    parameters = [parameter.replace(annotation=parameter.empty) for parameter in plain.parameters.values()]
    return str(plain.replace(parameters=parameters, return_annotation=plain.empty))


def _expect(**found_and_expected: tuple[Any, Any]) -> str | None:
    """What differs, as ``name is X, not Y``; None when every found value is the expected one."""
    differs = [
        f"{name.replace('__', '.')} is {found!r}, not {expected!r}"
        for name, (found, expected) in found_and_expected.items()
        if found != expected
    ]
    return "; ".join(differs) or None


def _hivemind_framing() -> str | None:
    """hivemind's stream message: a one-byte marker, an 8-byte big-endian length, the body in 64 KiB chunks."""
    from hivemind.p2p import P2P

    return _expect(
        P2P__MESSAGE_MARKER=(P2P.MESSAGE_MARKER, b"\x00"),
        P2P__ERROR_MARKER=(P2P.ERROR_MARKER, b"\x01"),
        P2P__HEADER_LEN=(P2P.HEADER_LEN, 8),
        P2P__BYTEORDER=(P2P.BYTEORDER, "big"),
        P2P__send_raw_data=(_signature(P2P.send_raw_data), "(data, writer, *, chunk_size=65536)"),
    )


def _write_messages_whole() -> None:
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings import control
    from hivemind.proto.p2pd_pb2 import RPCError

    chunk = 2**16  # as hivemind's send_raw_data: a long body goes in chunks of this size

    async def send_protobuf(protobuf: Any, writer: asyncio.StreamWriter) -> None:
        marker = P2P.ERROR_MARKER if isinstance(protobuf, RPCError) else P2P.MESSAGE_MARKER
        body = memoryview(protobuf.SerializeToString())
        writer.write(b"".join((marker, len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER), body[:chunk])))
        for offset in range(chunk, len(body), chunk):
            writer.write(body[offset : offset + chunk])
        await writer.drain()

    P2P.send_protobuf = staticmethod(send_protobuf)
    control.write_pbmsg = _write_pbmsg_whole


async def _write_pbmsg_whole(stream: asyncio.StreamWriter, pbmsg: Any) -> None:
    body = pbmsg.SerializeToString()
    size, varint = len(body), bytearray()
    while True:  # an unsigned varint, 7 bits a byte, least significant first
        varint.append(size & 0x7F | (0x80 if size >> 7 else 0))
        size >>= 7
        if not size:
            break
    stream.write(bytes(varint) + body)
    await stream.drain()


def _bound_msgpack_decoding() -> None:
    from hivemind.utils.serializer import MSGPackSerializer

    from petals.bounded_msgpack import checking

    MSGPackSerializer.loads = staticmethod(checking(MSGPackSerializer.loads))


# set while petals creates a P2P: the p2pd processes started meanwhile (see p2pd_started_apart)
_p2pd_started: contextvars.ContextVar[list[asyncio.subprocess.Process] | None] = contextvars.ContextVar(
    "p2pd_started", default=None
)


def _start_p2pd_apart() -> None:
    import asyncio.subprocess

    original = asyncio.subprocess.create_subprocess_exec

    @functools.wraps(original)  # its signature stays the original's, which the shape check reads
    async def create_subprocess_exec(program: Any, *args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        started = _p2pd_started.get()
        if started is None or Path(str(program)).name != "p2pd":
            return await original(program, *args, **kwargs)
        process = await original(program, *args, start_new_session=True, **kwargs)
        if process.stdout is not None:
            process.stdout = _LastLines(process.stdout)
        for arg in args:
            if str(arg).startswith("-listen=/unix/"):
                _p2pd_sockets[process] = str(arg).removeprefix("-listen=/unix")
        started.append(process)
        return process

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


class _LastLines:
    """A p2pd's stdout as hivemind reads it, keeping its last lines (hivemind's error quotes only the
    very last, which may be a log line another goroutine wrote after the reason the daemon exits)."""

    def __init__(self, reader: asyncio.StreamReader, keep: int = 32) -> None:
        self._reader = reader
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)

    async def readline(self) -> bytes:
        line = await self._reader.readline()
        if line:
            self.lines.append(line.rstrip().decode(errors="ignore"))
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


# the control socket of each p2pd started within p2pd_started_apart: one that exits at start leaves it behind
_p2pd_sockets: weakref.WeakKeyDictionary[asyncio.subprocess.Process, str] = weakref.WeakKeyDictionary()


def remove_p2pd_socket(process: asyncio.subprocess.Process) -> None:
    """Delete the control socket file of an exited p2pd (hivemind deletes it only for one it stopped)."""
    path = _p2pd_sockets.pop(process, None)
    if path is not None and process.returncode is not None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def p2pd_exit_reason(process: asyncio.subprocess.Process) -> str | None:
    """The last line a p2pd started within ``p2pd_started_apart`` wrote that is not a JSON log
    record: what the daemon printed when it gave up (Go's ``log.Fatal``), if it printed one."""
    lines = getattr(process.stdout, "lines", ())
    reasons = [line for line in lines if line and not line.startswith("{")]
    return reasons[-1] if reasons else None


def _msgpack_shape() -> str | None:
    from hivemind.utils.serializer import MSGPackSerializer

    return _expect(MSGPackSerializer__loads=(_signature(MSGPackSerializer.loads), "(buf)"))


def _p2pd_start_shape() -> str | None:
    import asyncio.subprocess

    from hivemind.p2p import P2P

    if "asyncio.subprocess.create_subprocess_exec(" not in inspect.getsource(P2P.create):
        return "P2P.create does not start p2pd through asyncio.subprocess.create_subprocess_exec"
    return _expect(
        create_subprocess_exec=(
            _signature(asyncio.subprocess.create_subprocess_exec),
            "(program, *args, stdin=None, stdout=None, stderr=None, limit=65536, **kwds)",
        )
    )


def _stream_handler_shape() -> str | None:
    from hivemind.p2p import P2P

    if "reader.readexactly(content_length)" not in inspect.getsource(P2P.receive_raw_data):
        return "P2P.receive_raw_data does not read a body with one readexactly(length)"
    return _hivemind_framing() or _expect(
        P2P__add_binary_stream_handler=(
            _signature(P2P.add_binary_stream_handler),
            "(self, name, handler, balanced=False)",
        )
    )


def _message_writes_shape() -> str | None:
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings import control, utils

    return _hivemind_framing() or _expect(
        P2P__send_protobuf=(_signature(P2P.send_protobuf), "(protobuf, writer)"),
        control__write_pbmsg=(_signature(control.write_pbmsg), "(stream, pbmsg)"),
        control__write_pbmsg__origin=(control.write_pbmsg in (utils.write_pbmsg, _write_pbmsg_whole), True),
    )


HIVEMIND = ("hivemind 1.1.12",)

BOUNDED_MSGPACK = Patch(
    "hivemind.utils.serializer:MSGPackSerializer.loads",
    HIVEMIND,
    reason="refuse MessagePack nested too deep or too large before the C decoder recurses into it",
    shape=_msgpack_shape,
    install=_bound_msgpack_decoding,
)
P2PD_APART = Patch(
    "asyncio.subprocess:create_subprocess_exec",
    HIVEMIND,
    reason="P2P.create starts p2pd through it and offers no start_new_session option",
    shape=_p2pd_start_shape,
    install=_start_p2pd_apart,
)
INBOUND_MESSAGE_LIMIT = Patch(
    "hivemind.p2p:P2P.add_binary_stream_handler (of one P2P instance)",
    HIVEMIND,
    reason="P2P registers its stream handlers through it and reads a message body with one "
    "readexactly(length), however long the length header says it is",
    shape=_stream_handler_shape,
)
WHOLE_MESSAGES = Patch(
    "hivemind.p2p:P2P.send_protobuf, hivemind.p2p.p2p_daemon_bindings.control:write_pbmsg",
    HIVEMIND,
    reason="each writes one message to the p2p daemon in several writes (a stream message in three, "
    "a unary message's length byte by byte), each a system call the daemon may forward on its own",
    shape=_message_writes_shape,
    install=_write_messages_whole,
)
PATCHES: tuple[Patch, ...] = (BOUNDED_MSGPACK, P2PD_APART, INBOUND_MESSAGE_LIMIT, WHOLE_MESSAGES)


@functools.cache
def _fits_once(patch: Patch) -> bool:
    return patch.fits()


_applied: set[str] = set()
_skipped: set[str] = set()  # checked, and left alone: their shape differs
_applying = threading.Lock()


def apply_patches(patches: Sequence[Patch] = PATCHES) -> None:
    """Install the process-wide ``patches`` not installed yet, each where its target has its shape."""
    with _applying:
        for patch in patches:
            if patch.install is None or patch.target in _applied | _skipped:
                continue
            if patch.fits():
                patch.install()
                _applied.add(patch.target)
            else:
                _skipped.add(patch.target)


@contextlib.contextmanager
def p2pd_started_apart() -> Iterator[list[asyncio.subprocess.Process]]:
    """Within: every p2pd that hivemind starts runs in a session of its own; yields them as they start
    (none where hivemind starts p2pd otherwise than ``P2PD_APART`` knows: it stays in our session)."""
    if P2PD_APART.target not in _applied | _skipped:
        raise RuntimeError("p2pd_started_apart needs apply_patches() first")
    started: list[asyncio.subprocess.Process] = []
    token = _p2pd_started.set(started)
    try:
        yield started
    finally:
        _p2pd_started.reset(token)


def limit_inbound_message_size(p2p: P2P, max_bytes: int) -> None:
    """Refuse any message longer than ``max_bytes`` that another peer sends on a stream to one of
    ``p2p``'s handlers registered after this call, before reading its body; and let those handlers'
    streams that end in an error close after their caller.

    Unary calls are capped by the daemon; streams are not. The stream is closed unread (hivemind
    logs the ``MessageTooLarge`` and closes it) and one INFO line says so. Streams this ``p2p``
    opens as a client, and other ``P2P`` instances, keep hivemind's behaviour. Calling it again
    changes the limit of the streams that open afterwards.

    Why the close waits: when a handler closes its end, p2pd (``doStreamPipe``) closes the libp2p
    stream for reading and writing, its other copying goroutine then fails to read and *resets* the
    stream, and a reset that reaches the caller's side before the caller's daemon has read the last
    message discards that message (yamux drops buffered data on reset). The last message of a failed
    stream is its error, so after sending one the stream is closed only once the caller has closed
    its end (hivemind's client closes as soon as it reads the error), or after
    ``CALLER_CLOSE_GRACE`` seconds. Successful streams close at once: a caller reads until the close.
    """
    if not _fits_once(INBOUND_MESSAGE_LIMIT):  # its debug line says why; hivemind reads streams whole
        return
    registering = vars(p2p).get("add_binary_stream_handler")
    if isinstance(registering, _BoundedStreams):
        registering.max_bytes = max_bytes
        return
    p2p.add_binary_stream_handler = _BoundedStreams(p2p.add_binary_stream_handler, max_bytes)


CALLER_CLOSE_GRACE = 5.0  # seconds a failed stream waits for its caller to close first


class _BoundedStreams:
    """``P2P.add_binary_stream_handler`` of one instance, whose handlers read through a
    ``_BoundedReader`` and write through an ``_ErrorAwareWriter``."""

    def __init__(self, register: Callable, max_bytes: int) -> None:
        self.register, self.max_bytes = register, max_bytes

    async def __call__(self, name: str, handler: Callable, balanced: bool = False) -> None:
        async def bounded_handler(stream_info: Any, reader: asyncio.StreamReader, writer: Any) -> None:
            watched = _ErrorAwareWriter(writer)
            try:
                await handler(stream_info, _BoundedReader(reader, self.max_bytes), watched)
                if watched.sent_error:
                    await _until_caller_closes(reader, CALLER_CLOSE_GRACE)
            finally:
                writer.close()

        await self.register(name, bounded_handler, balanced)


class _ErrorAwareWriter:
    """A stream's writer that notes whether an error was sent and leaves closing to ``_BoundedStreams``.

    It follows hivemind's framing of what is written (``P2P.send_protobuf``: a one-byte marker, an
    8-byte length, the body in chunks), so that only a marker counts: a body chunk may be that byte too.
    """

    def __init__(self, writer: Any) -> None:
        from hivemind.p2p import P2P

        self._writer, self.sent_error = writer, False
        self._framing = P2P
        self._header: bytearray | None = None  # None: the next byte is a message's marker
        self._body_left = 0

    def write(self, data: bytes) -> None:
        self._writer.write(data)
        view = memoryview(data)
        while view:
            if self._body_left:
                taken = min(self._body_left, len(view))
                self._body_left -= taken
            elif self._header is None:
                self.sent_error = self.sent_error or view[:1] == self._framing.ERROR_MARKER
                self._header, taken = bytearray(), 1
            else:
                taken = self._framing.HEADER_LEN - len(self._header)
                self._header += view[:taken]
                if len(self._header) == self._framing.HEADER_LEN:
                    self._body_left = int.from_bytes(self._header, self._framing.BYTEORDER)
                    self._header = None
            view = view[taken:]

    def close(self) -> None:
        """The handler is done; the stream is closed when ``_BoundedStreams``' handler returns."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


async def _until_caller_closes(reader: asyncio.StreamReader, timeout: float) -> None:
    """Read and drop what the caller still sends until it closes its end, for at most ``timeout`` s."""
    import asyncio

    with contextlib.suppress(Exception):  # a broken connection is closed too
        async with asyncio.timeout(timeout):
            await asyncio.sleep(0)  # hivemind has just cancelled its pending read: let it let go first
            while await reader.read(2**16):
                pass


class _BoundedReader:
    """A stream's reader that refuses to read more than ``max_bytes`` at once: hivemind reads each
    message's body with one ``readexactly(length)`` (its marker and length header take 1 and 8 bytes)."""

    def __init__(self, reader: asyncio.StreamReader, max_bytes: int) -> None:
        self._reader, self._max_bytes = reader, max_bytes

    async def readexactly(self, length: int) -> bytes:
        if length > self._max_bytes:
            from petals.wire import MessageTooLarge

            logger.info(
                "Refused a %d-byte stream message (this server's limit: %d bytes)", length, self._max_bytes
            )
            raise MessageTooLarge(
                f"a {length}-byte message exceeds this server's limit of {self._max_bytes} bytes"
            )
        return await self._reader.readexactly(length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


# ---- import patches ------------------------------------------------------------------------------

# what the __init__ of three hivemind 1.1.12 packages exports: each name, and the module that defines it
_HIVEMIND_EXPORTS = {
    "hivemind": {
        "DecentralizedAverager": "hivemind.averaging",
        "DHT": "hivemind.dht",
        "ModuleBackend": "hivemind.moe",
        "RemoteExpert": "hivemind.moe",
        "RemoteMixtureOfExperts": "hivemind.moe",
        "RemoteSwitchMixtureOfExperts": "hivemind.moe",
        "Server": "hivemind.moe",
        "register_expert_class": "hivemind.moe",
        "GradScaler": "hivemind.optim",
        "Optimizer": "hivemind.optim",
        "TrainingAverager": "hivemind.optim",
    },
    "hivemind.dht": {
        "DHT": "hivemind.dht.dht",
        "DHTNode": "hivemind.dht.node",
        "DHTID": "hivemind.dht.routing",
        "DHTValue": "hivemind.dht.routing",
    },
    "hivemind.utils": {
        **dict.fromkeys(
            ("as_aiter", "amap_in_executor", "switch_to_uvloop", "enter_asynchronously"),
            "hivemind.utils.asyncio",
        ),
        "get_logger": "hivemind.utils.logging",
        "MPFuture": "hivemind.utils.mpfuture",
        **dict.fromkeys(("nested_flatten", "nested_pack", "nested_map"), "hivemind.utils.nested"),
        "PerformanceEMA": "hivemind.utils.performance_ema",
        "MSGPackSerializer": "hivemind.utils.serializer",
        "SerializerBase": "hivemind.utils.serializer",
        "TensorDescriptor": "hivemind.utils.tensor_descr",
        **dict.fromkeys(
            (
                "DHTExpiration",
                "ValueWithExpiration",
                "get_dht_time",
                "MAX_DHT_TIME_DISCREPANCY_SECONDS",
                "TimedStorage",
            ),
            "hivemind.utils.timed_storage",
        ),
    },
}


def _hivemind_exports_on_access(
    module: types.ModuleType, exec_module: Callable[[types.ModuleType], None]
) -> None:
    """Instead of the package's ``__init__``: each name it exports is imported on first access, from the
    module that defines it (so that, say, ``from hivemind.utils import get_logger`` does not import torch
    through ``hivemind.utils.mpfuture``); a submodule is imported on first access as an attribute, as the
    ``__init__`` would have imported it."""
    exports = _HIVEMIND_EXPORTS[module.__name__]

    def exported(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{module.__name__}.{name}") is not None:
            value = importlib.import_module(f"{module.__name__}.{name}")
        else:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        setattr(module, name, value)
        return value

    if module.__name__ == "hivemind":
        module.__version__ = importlib.metadata.version("hivemind")
    module.__getattr__ = exported
    module.__all__ = list(exports)


@dataclass(frozen=True)
class ImportPatch:
    module: str  # the module whose import it changes
    patch: Patch
    exec_module: Callable[
        [types.ModuleType, Callable[[types.ModuleType], None]], None
    ]  # runs instead of the loader's


def _package_file(module: str, name: str = "__init__.py") -> Path:
    """A file of the package ``module``, found as the import system would find it, without importing it."""
    parent = module.rpartition(".")[0]
    path = importlib.import_module(parent).__path__ if parent else None
    spec = importlib.machinery.PathFinder.find_spec(module, path)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"no package {module} on the path")
    return Path(next(iter(spec.submodule_search_locations))) / name


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, tried again where CPython 3.11's ast turned another thread's parse into an error.

    CPython before 3.11.8 keeps the depth of the AST it is building per interpreter, not per thread
    (gh-106905): a parse that overlaps one in another thread (a server's patches checked while the
    client's are) can fail with ``SystemError: AST constructor recursion depth mismatch`` although the
    source is fine. The same source parsed again, once the other parse is done, gives the tree."""
    for attempt in range(5):
        try:
            return ast.parse(source, filename)
        except SystemError as error:
            if "recursion depth mismatch" not in str(error) or attempt == 4:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def _exports_shape(package: str) -> Callable[[], str | None]:
    """Whether the package's ``__init__`` imports exactly the names ``_HIVEMIND_EXPORTS`` exports, from
    the same modules."""

    def shape() -> str | None:
        init = parse_source(_package_file(package).read_text())
        imports = {
            alias.asname or alias.name: node.module
            for node in init.body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        exports = _HIVEMIND_EXPORTS[package]
        if imports != exports:
            return f"its __init__ imports differ in {sorted(set(imports.items()) ^ set(exports.items()))}"
        return None

    return shape


LAZY_HIVEMIND = ImportPatch(
    "hivemind",
    Patch(
        "hivemind:__init__",
        HIVEMIND,
        reason="its __init__ imports averaging (and scipy), moe and optim to export names petals does not use",
        shape=_exports_shape("hivemind"),
    ),
    _hivemind_exports_on_access,
)
LAZY_HIVEMIND_DHT = ImportPatch(
    "hivemind.dht",
    Patch(
        "hivemind.dht:__init__",
        HIVEMIND,
        reason="its __init__ imports DHT, the multiprocessing wrapper petals does not use, and torch with it",
        shape=_exports_shape("hivemind.dht"),
    ),
    _hivemind_exports_on_access,
)
LAZY_HIVEMIND_UTILS = ImportPatch(
    "hivemind.utils",
    Patch(
        "hivemind.utils:__init__",
        HIVEMIND,
        reason="its __init__ imports torch (through mpfuture and tensor_descr) for every module of hivemind "
        "that needs a logger, so that a DHT-only peer (petals dht, monitor, health) imported torch",
        shape=_exports_shape("hivemind.utils"),
    ),
    _hivemind_exports_on_access,
)


_deferred_packages: dict[str, _InitOnAccess] = {}


class _InitOnAccess:
    """``module``'s ``__init__`` runs on the first access to a name it does not have yet
    (``module.__getattr__``) or the first import of a submodule other than ``independent`` ones, as Python
    would run it before any submodule. ``stand_ins`` answer some names until then."""

    def __init__(
        self,
        module: types.ModuleType,
        exec_module: Callable[[types.ModuleType], None],
        stand_ins: dict[str, Any],
        independent: Sequence[str],
        loaded: Callable[[types.ModuleType], None] = lambda module: None,
    ) -> None:
        self.module, self.exec_module, self.stand_ins, self.loaded = module, exec_module, stand_ins, loaded
        self.independent = {f"{module.__name__}.{name}" for name in independent}
        self.state = "deferred"  # then "running" (its __init__ is executing), then "done"
        self.lock = threading.RLock()
        module.__getattr__ = self.attribute
        _deferred_packages[module.__name__] = self

    def attribute(self, name: str) -> Any:
        if self.state == "deferred" and name in self.stand_ins:
            return self.stand_ins[name]
        self.load()
        if self.state == "running":  # its own __init__ asks for a name it has not defined yet
            raise AttributeError(
                f"partially initialized module {self.module.__name__!r} has no attribute {name!r}"
            )
        return getattr(self.module, name)

    def load(self, wait: bool = True) -> types.ModuleType:
        """Run its ``__init__`` unless it has run or is running; ``wait=False``: unless another thread runs it
        (an import there proceeds meanwhile, as Python's does while a package initializes in another thread)."""
        if not self.lock.acquire(blocking=wait):
            return self.module
        try:
            if self.state == "deferred":
                self.state = "running"
                try:
                    self.exec_module(self.module)
                finally:
                    if vars(self.module).get("__getattr__") == self.attribute:
                        del self.module.__getattr__
                    self.state = "done"
                self.loaded(self.module)
        finally:
            self.lock.release()
        return self.module


def _dynamo_on_access(module: types.ModuleType, exec_module: Callable[[types.ModuleType], None]) -> None:
    when_loaded: list[Callable[[types.ModuleType], None]] = []  # the marks made before it loaded

    def loaded(dynamo: types.ModuleType) -> None:
        for apply in when_loaded:
            apply(dynamo)
        when_loaded.clear()

    deferred = _InitOnAccess(module, exec_module, {}, ["_trace_wrapped_higher_order_op"], loaded)

    def when_dynamo_loads(apply: Callable[[types.ModuleType], None]) -> None:
        with deferred.lock:
            if deferred.state == "done":  # a stand-in kept and used after all
                apply(module)
            else:
                when_loaded.append(apply)

    def mark_later(decorator: str) -> Callable[[Any], Any]:
        def mark(fn: Any) -> Any:  # allow_in_graph and assume_constant_result return fn itself
            when_dynamo_loads(lambda dynamo: getattr(dynamo, decorator)(fn))
            return list(fn) if isinstance(fn, list | tuple) else fn

        return mark

    def disable(
        fn: Any = None, recursive: bool = True, *, reason: str | None = None, wrapping: bool = True
    ) -> Any:
        if fn is None:
            if recursive:  # a DisableContext: also a context manager, so it needs dynamo now
                return deferred.load().disable(None, True, reason=reason, wrapping=wrapping)
            return functools.partial(disable, recursive=False, reason=reason, wrapping=wrapping)
        target = fn

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return target(*args, **kwargs)

        def disable_now(dynamo: types.ModuleType) -> None:
            nonlocal target
            target = dynamo.disable(fn, recursive, reason=reason, wrapping=wrapping)

        when_dynamo_loads(disable_now)
        return call

    deferred.stand_ins.update(
        disable=disable,
        allow_in_graph=mark_later("allow_in_graph"),
        assume_constant_result=mark_later("assume_constant_result"),
    )


def _scipy_optimize_on_access(
    module: types.ModuleType, exec_module: Callable[[types.ModuleType], None]
) -> None:
    from scipy.optimize._lsap import linear_sum_assignment

    _InitOnAccess(module, exec_module, {"linear_sum_assignment": linear_sum_assignment}, ["_lsap"])


# what the stand-ins take and hand on (torch.compiler.disable calls disable(fn, recursive, reason=...))
_DYNAMO_MARKS = {
    "disable": "(fn=None, recursive=True, *, reason=None, wrapping=True)",
    "allow_in_graph": "(fn)",
    "assume_constant_result": "(fn)",
}


def _dynamo_shape() -> str | None:
    """The marks' signatures in ``torch/_dynamo/decorators.py``, read without importing it, and the one
    submodule transformers imports on its own."""
    if not _package_file("torch._dynamo", "_trace_wrapped_higher_order_op.py").is_file():
        return "torch._dynamo has no _trace_wrapped_higher_order_op module"
    tree = parse_source(_package_file("torch._dynamo", "decorators.py").read_text())
    found = {
        node.name: f"({ast.unparse(node.args)})"
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in _DYNAMO_MARKS
    }
    return _expect(
        **{f"decorators__{name}": (found.get(name), marks) for name, marks in _DYNAMO_MARKS.items()}
    )


def _scipy_optimize_shape() -> str | None:
    if "from ._lsap import linear_sum_assignment" not in _package_file("scipy.optimize").read_text():
        return "scipy.optimize does not take linear_sum_assignment from its _lsap module"
    return None


LAZY_DYNAMO = ImportPatch(
    "torch._dynamo",
    Patch(
        "torch._dynamo:__init__",
        ("torch 2.13.0",),
        reason="transformers imports it on every model import to mark functions for a compiler a server never runs",
        shape=_dynamo_shape,
    ),
    _dynamo_on_access,
)
LAZY_SCIPY_OPTIMIZE = ImportPatch(
    "scipy.optimize",
    Patch(
        "scipy.optimize:__init__",
        ("scipy 1.17.1",),
        reason="transformers' object-detection losses import linear_sum_assignment on every model import",
        shape=_scipy_optimize_shape,
    ),
    _scipy_optimize_on_access,
)
IMPORT_PATCHES: tuple[ImportPatch, ...] = (
    LAZY_HIVEMIND,
    LAZY_HIVEMIND_DHT,
    LAZY_HIVEMIND_UTILS,
    LAZY_DYNAMO,
    LAZY_SCIPY_OPTIMIZE,
)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: ImportPatch) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.patch.exec_module(module, self.loader.exec_module)


class _AlreadyImported(importlib.abc.Loader):
    """Hands the import system a module that a finder's work has just imported. Python's import takes such
    a module's ``__spec__`` and would execute it again (``importlib._bootstrap._find_spec``), so the module
    carries ``spec`` (this loader's) until ``exec_module`` gives it back its own."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module, self.own_spec = module, module.__spec__
        self.spec = importlib.machinery.ModuleSpec(module.__name__, self, origin=self.own_spec.origin)
        self.spec.submodule_search_locations = self.own_spec.submodule_search_locations
        module.__spec__ = self.spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.own_spec


class _ImportPatchFinder(importlib.abc.MetaPathFinder):
    """Finds the patched modules through the finders after it, and wraps their loader."""

    def __init__(self, patches: Sequence[ImportPatch]) -> None:
        self.patches = {patch.module: patch for patch in patches}

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package = _deferred_packages.get(name.rpartition(".")[0])
        if package is not None and name not in package.independent:
            package.load(wait=False)  # the thread importing this submodule holds its module lock
            if name in sys.modules:  # the package's __init__ has just imported it
                return _AlreadyImported(sys.modules[name]).spec
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not patch.patch.fits():
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install_import_patches(patches: Sequence[ImportPatch] = IMPORT_PATCHES) -> None:
    """Put the finder of ``patches`` first in ``sys.meta_path`` (once); modules imported already stay as they are."""
    if not any(isinstance(finder, _ImportPatchFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportPatchFinder(patches))


# ---- petals commands' view of torch.distributed --------------------------------------------------------


def _torch_distributed_unused() -> None:
    import transformers.utils
    import transformers.utils.import_utils

    def is_torch_distributed_available() -> bool:
        return False

    transformers.utils.import_utils.is_torch_distributed_available = is_torch_distributed_available
    transformers.utils.is_torch_distributed_available = is_torch_distributed_available


def _torch_distributed_shape() -> str | None:
    import transformers.utils
    import transformers.utils.import_utils

    asked = transformers.utils.import_utils.is_torch_distributed_available
    return _expect(
        is_torch_distributed_available=(_signature(asked), "()"),
        transformers__utils__is_torch_distributed_available=(
            transformers.utils.is_torch_distributed_available is asked,
            True,
        ),
    )


TORCH_DISTRIBUTED_UNUSED = Patch(
    "transformers.utils.import_utils:is_torch_distributed_available",
    ("transformers 5.24.0",),
    reason="transformers' loading code imports DTensor and FSDP (and, through them, sympy) at module level "
    "whenever torch.distributed is built in, for process groups petals' commands never create",
    shape=_torch_distributed_shape,
    install=_torch_distributed_unused,
)


def without_torch_distributed() -> None:
    """Make transformers treat torch.distributed as absent in this process: petals' commands call it first.

    A server or a command's client never creates a process group (a server's tensor parallelism is the
    ``tensor_parallel`` library's, in one process), so transformers' parallel code has nothing to do
    there, but its loading code imports ``torch.distributed.tensor`` and FSDP at module level, and sympy
    through them: 43 MiB and 0.8 s of a server's start. Does nothing once any of that code is imported
    (its ``if`` ran already) or where ``is_torch_distributed_available`` has another shape."""
    if any(name.startswith("transformers.distributed") for name in sys.modules):
        return
    apply_patches([TORCH_DISTRIBUTED_UNUSED])


# ---- GGUF files: parsed once, in bulk ----------------------------------------------------------------


def _gguf_shape() -> str | None:
    import gguf

    return _expect(
        GGUFReader=(_signature(gguf.GGUFReader), "(path, mode='r')"),
        get_tensor_name_map=(_signature(gguf.get_tensor_name_map), "(arch, n_blocks)"),
    )


GGUF_PARSED_ONCE = Patch(
    "gguf:GGUFReader, gguf:get_tensor_name_map (within gguf_parsed_once)",
    ("gguf 0.19.0 with transformers 5.24.0",),
    reason="transformers parses a GGUF file's metadata anew for the config, the tokenizer and the weights "
    "(SmolLM2's 100,000 vocabulary fields: about 5 s each on two cores), and builds gguf's tensor name "
    "map once per module of the model (397 times for SmolLM2)",
    shape=_gguf_shape,
)


class _GGUFPatch:
    """gguf as patched while any thread is within ``gguf_parsed_once``: installed by the first thread
    to enter, restored by the last to leave (threads enter and leave in any order: a client and
    servers loading at once in one process). Each thread reads through its own innermost block's
    readers; a thread outside every block gets new readers, as from the unpatched gguf."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: tuple[Any, Any] = (None, None)
        self.restore_values: Callable[[], None] = lambda: None  # undoes GGUF_VALUES_SOONER
        self.local = threading.local()  # .blocks: this thread's open blocks, innermost last

    def enter(self, gguf: Any, block: Callable[[str | os.PathLike[str]], Any]) -> None:
        with self.lock:
            if self.depth == 0:
                self.saved = (gguf.GGUFReader, gguf.get_tensor_name_map)
                gguf.GGUFReader, gguf.get_tensor_name_map = self.read, functools.cache(self.saved[1])
                self.restore_values = _read_gguf_values_sooner()
            self.depth += 1
        self.blocks().append(block)

    def leave(self, gguf: Any) -> None:
        self.blocks().pop()
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = self.saved
                self.restore_values()

    def blocks(self) -> list[Callable[[str | os.PathLike[str]], Any]]:
        if not hasattr(self.local, "blocks"):
            self.local.blocks = []
        return self.local.blocks

    def read(self, path: str | os.PathLike[str], mode: str = "r") -> Any:
        blocks = self.blocks()
        if mode != "r" or not blocks:  # a writable map is not ours to share
            return self.saved[0](path, mode)
        return blocks[-1](path)


_GGUF_PATCH = _GGUFPatch()


@contextlib.contextmanager
def gguf_parsed_once(shared: Callable[[str | os.PathLike[str]], Any] | None = None) -> Iterator[None]:
    """Within: each GGUF file is parsed once and each tensor name map built once, however often
    transformers asks. Readers only read (a memory map opened read-only), so sharing one is safe; the
    block ends with gguf as it was once no thread is within one (``_GGUFPatch``). Where gguf has another
    shape, or is not installed, it changes nothing.
    ``shared``: where readers come from (a path -> reader cache that outlives the block), if not new."""
    if not GGUF_PARSED_ONCE.fits():
        yield
        return
    import gguf

    readers: dict[str, Any] = {}

    def parsed_once(path: str | os.PathLike[str]) -> Any:
        if shared is not None:
            return shared(path)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = _GGUF_PATCH.saved[0](path)
        return readers[key]

    _GGUF_PATCH.enter(gguf, parsed_once)
    try:
        yield
    finally:
        _GGUF_PATCH.leave(gguf)


def _gguf_reader_shape() -> str | None:
    from gguf.gguf_reader import GGUFReader

    return _expect(
        GGUFReader=(_signature(GGUFReader), "(path, mode='r')"),
        GGUFReader___get=(_signature(GGUFReader._get), "(self, offset, dtype, count=1, override_order=None)"),
        GGUFReader___get_field_parts=(_signature(GGUFReader._get_field_parts), "(self, orig_offs, raw_type)"),
        GGUFReader__gguf_scalar_to_np=(isinstance(GGUFReader.gguf_scalar_to_np, dict), True),
    )


GGUF_METADATA_IN_BULK = Patch(
    "gguf.gguf_reader:GGUFReader._get_field_parts, GGUFReader._get (overridden by petals' GGUF reader)",
    ("gguf 0.19.0",),
    reason="gguf's reader builds every element of a metadata array on its own, through the file's memory "
    "map (Gemma 3's 262,144-token vocabulary: 24 s on two cores), and a file shorter than its contents "
    "fails later, in a reshape that names neither the file nor the cause",
    shape=_gguf_reader_shape,
)


class _BulkMetadata:
    """In front of gguf's ``GGUFReader`` (``gguf_reader``): an array of strings or numbers in the
    metadata is copied out of the file at once, and its elements' parts are views of that copy: the same
    values, types and layout gguf builds one read at a time (each a slice of the memory map, which runs
    numpy's Python-level memmap code). A read past the end of the file raises ``ValueError`` saying so,
    where gguf would read a shorter array than it asked for and fail further on."""

    data: Any  # gguf's memory map of the whole file
    byte_order: str
    gguf_scalar_to_np: dict

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> Any:
        import numpy as np

        self._within(int(offset) + np.dtype(dtype).itemsize * int(count))
        return super()._get(offset, dtype, count, override_order)

    def _within(self, end: int) -> None:
        if end > len(self.data):
            what = "tensor data" if "data_offset" in vars(self) else "metadata"
            raise ValueError(f"it is {len(self.data)} bytes long, and its {what} runs to byte {end} at least")

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        import numpy as np
        from gguf.constants import GGUFValueType

        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":  # "I": the file's order is ours
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        start, item, count = orig_offs + 12, int(item_type[0]), int(length[0])
        if item == GGUFValueType.STRING:
            elements, end = self._strings(start, count)
        elif item in self.gguf_scalar_to_np:
            elements, end = self._numbers(start, count, self.gguf_scalar_to_np[GGUFValueType(item)])
        else:  # arrays of arrays: gguf's own way
            return super()._get_field_parts(orig_offs, raw_type)
        per_element = 2 if item == GGUFValueType.STRING else 1  # a string's parts: its length, its bytes
        data = list(range(1 + per_element, 2 + per_element * count, per_element))  # each one's last part
        types = [GGUFValueType.ARRAY, GGUFValueType(item)] if count else [GGUFValueType.ARRAY]
        return end - orig_offs, [item_type, length, *elements], data, types

    def _strings(self, start: int, count: int) -> tuple[list, int]:
        """Each string's parts (its uint64 length, its bytes), views of two arrays; and where they end."""
        import struct

        import numpy as np

        self._within(start + 8 * count)  # 8 bytes each at least: a garbage count fails here, not in a loop
        length_at = struct.Struct("=Q").unpack_from  # "=": our byte order, which is the file's
        lengths, end = [], start
        try:
            for _ in range(count):
                lengths.append(length_at(self.data, end)[0])
                end += 8 + lengths[-1]
        except struct.error:  # a garbage length took it past the end
            self._within(end + 8)
            raise
        self._within(end)
        copied, sizes = np.array(self.data[start:end]), np.array(lengths, dtype=np.uint64)
        parts, first = [], 8
        for index, length in enumerate(lengths):
            parts += (sizes[index : index + 1], copied[first : first + length])
            first += length + 8
        return parts, end

    def _numbers(self, start: int, count: int, dtype: Any) -> tuple[list, int]:
        """Each number as a one-element view of one copy; and where they end."""
        import numpy as np

        end = start + np.dtype(dtype).itemsize * count
        self._within(end)
        values = np.array(self.data[start:end]).view(dtype)
        return [values[index : index + 1] for index in range(count)], end


@functools.cache
def _bulk_gguf_reader() -> type:
    from gguf.gguf_reader import GGUFReader

    return type("BulkGGUFReader", (_BulkMetadata, GGUFReader), {"__module__": __name__})


def gguf_reader(path: str | os.PathLike[str]) -> Any:
    """A ``gguf.GGUFReader`` of ``path``, read-only: where gguf has the shape ``GGUF_METADATA_IN_BULK`` was
    written for, one that reads metadata arrays in bulk (``_BulkMetadata``: the same fields and tensors,
    50 times sooner for a large vocabulary) and says so where the file is shorter than its contents."""
    if not _fits_once(GGUF_METADATA_IN_BULK):
        from gguf.gguf_reader import GGUFReader

        return GGUFReader(path)
    return _bulk_gguf_reader()(path)


# transformers' metadata value types (``integrations/ggml.py``: ``_gguf_parse_value``)
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_INTEGERS, _GGUF_FLOATS = frozenset((0, 1, 2, 3, 4, 5, 10, 11)), frozenset((6, 12))


def _gguf_values_shape() -> str | None:
    from transformers import modeling_gguf_pytorch_utils as loading
    from transformers.integrations import ggml

    used = loading._gguf_parse_value
    return _expect(
        ggml___gguf_parse_value=(_signature(ggml._gguf_parse_value), "(_value, data_type)"),
        modeling_gguf_pytorch_utils___gguf_parse_value=(
            used is ggml._gguf_parse_value or used.__module__ == __name__,
            True,
        ),
    )


GGUF_VALUES_SOONER = Patch(
    "transformers.modeling_gguf_pytorch_utils:_gguf_parse_value (within gguf_parsed_once)",
    ("transformers 5.24.0",),
    reason="load_gguf_checkpoint (the config of most GGUF architectures, and the tokenizer) reads every element "
    "of every metadata array in two calls, a string through a list of numpy scalars (Gemma 3's vocabulary, "
    "scores and token types: 1.2 s on two cores)",
    shape=_gguf_values_shape,
)


def _read_gguf_values_sooner() -> Callable[[], None]:
    """Install ``GGUF_VALUES_SOONER`` where it fits; returns what undoes it."""
    if not _fits_once(GGUF_VALUES_SOONER):
        return lambda: None
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils as loading

    original, byte = loading._gguf_parse_value, np.dtype(np.uint8)

    def _gguf_parse_value(_value: Any, data_type: Any) -> Any:
        """An element of a metadata array as gguf's reader gives it (a numpy array of one number, or a
        string's bytes) read at once, the value transformers reads from it; anything else by transformers."""
        if type(data_type) is list and len(data_type) == 2 and data_type[0] == _GGUF_ARRAY:
            kind = data_type[1]
            if kind == _GGUF_STRING and isinstance(_value, np.ndarray) and _value.dtype == byte:
                return _value.tobytes().decode()  # what array("B", list(_value)).tobytes().decode() is
            if kind in _GGUF_FLOATS and isinstance(_value, np.ndarray):
                return float(_value[0])
            if kind in _GGUF_INTEGERS and isinstance(_value, np.ndarray):
                return int(_value[0])
        return original(_value, data_type)

    loading._gguf_parse_value = _gguf_parse_value

    def restore() -> None:
        loading._gguf_parse_value = original

    return restore
