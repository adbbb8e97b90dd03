"""MessagePack from the network, decoded only after its nesting depth and size are checked.

hivemind's ``MSGPackSerializer`` decodes its tuple ext type (and the DHT's dictionary values) by
calling ``msgpack.unpackb`` again from inside the ext hook, so every nested tuple costs one more
C-level unpack frame. Less than a kilobyte of nested tuples overflows the main thread's stack and the
process dies with SIGSEGV, which no ``except`` can catch (``tests/test_bounded_msgpack.py`` shows it
in a subprocess, with ``petals.testing.malformed.nested_tuples``). The same serializer decodes RPC
metadata and every DHT key, subkey and value, so one small request or one stored record could kill
every server and client that reads it.

``check_msgpack`` walks the bytes without recursion (an explicit stack, descending into hivemind's
ext payloads) and refuses anything deeper than ``MAX_DEPTH`` or larger than ``MAX_BYTES`` before
the C decoder sees it. ``checking`` puts that check in front of hivemind's decoder, for the whole
process (``petals.patches`` installs it); ``BoundedRecordValidator`` makes our DHT nodes refuse such records, so they are
neither stored nor returned by a search.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAX_DEPTH = 32  # Petals' own messages nest at most 4 levels (metadata → next_servers → tuple)
MAX_BYTES = 4 * 1024**2  # the p2p daemon's cap on a unary message
TUPLE_EXT_CODE = 0x40  # hivemind: a tuple, packed as a msgpack list
DICTIONARY_EXT_CODE = 0x50  # hivemind: DictionaryDHTValue, packed as a msgpack list
NESTED_EXT_CODES = frozenset({TUPLE_EXT_CODE, DICTIONARY_EXT_CODE})


class MsgpackLimitError(ValueError):
    """MessagePack that is malformed, nested deeper than ``MAX_DEPTH`` or larger than ``MAX_BYTES``."""


# first byte → (bytes of the length field, fixed payload size) for everything that is neither a
# container, an ext, nor a fixed-size scalar; containers and exts are handled below
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin8/16/32, str8/16/32
_FIXED = {
    **dict.fromkeys((0xC0, 0xC2, 0xC3), 0),  # nil, false, true
    0xCA: 4, 0xCB: 8,  # float32/64
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,  # uint8..64
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,  # int8..64
}  # fmt: skip
_ARRAYS = {0xDC: 2, 0xDD: 4}
_MAPS = {0xDE: 2, 0xDF: 4}
_EXTS = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXEXTS = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_UINT = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


def check_msgpack(buf: bytes, *, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> None:
    """Raise ``MsgpackLimitError`` unless ``buf`` is one MessagePack object within the limits.

    Containers and hivemind's nested ext payloads (tuples, DHT dictionaries) each count one level.
    """
    if len(buf) > max_bytes:
        raise MsgpackLimitError(f"MessagePack of {len(buf)} bytes exceeds the limit of {max_bytes}")
    view = memoryview(buf)
    pos = 0
    # each frame: [items still to read, the offset its items end at, whether that end must be exact]
    frames: list[list] = [[1, len(buf), True]]
    while frames:
        frame = frames[-1]
        if frame[0] == 0:
            if frame[2] and pos != frame[1]:
                raise MsgpackLimitError(f"{frame[1] - pos} stray bytes after a MessagePack object")
            frames.pop()
            continue
        frame[0] -= 1
        pos, items, payload_end = _read_header(view, pos, frame[1])
        if items or payload_end is not None:
            if len(frames) > max_depth:
                raise MsgpackLimitError(f"MessagePack nested deeper than {max_depth} levels")
            if payload_end is None:
                frames.append([items, frame[1], False])
            else:  # an ext payload holds exactly one object
                frames.append([1, payload_end, True])


def _read_header(view: memoryview, pos: int, end: int) -> tuple[int, int, int | None]:
    """One object's header at ``pos``: (position after what was consumed, items to read, ext payload end).

    Scalars, strings, binaries and unknown exts are consumed whole; a container returns how many
    items follow; an ext holding hivemind MessagePack returns where its payload ends.
    """
    if pos >= end:
        raise MsgpackLimitError("truncated MessagePack")
    first = view[pos]
    pos += 1
    if first <= 0x7F or first >= 0xE0:  # positive / negative fixint
        return pos, 0, None
    if 0x80 <= first <= 0x8F:
        return pos, _fits(2 * (first & 0x0F), pos, end), None
    if 0x90 <= first <= 0x9F:
        return pos, _fits(first & 0x0F, pos, end), None
    if 0xA0 <= first <= 0xBF:
        return _skip(pos, first & 0x1F, end), 0, None
    if first in _FIXED:
        return _skip(pos, _FIXED[first], end), 0, None
    if first in _SIZED:
        length, pos = _read_uint(view, pos, _SIZED[first], end)
        return _skip(pos, length, end), 0, None
    if first in _ARRAYS:
        count, pos = _read_uint(view, pos, _ARRAYS[first], end)
        return pos, _fits(count, pos, end), None
    if first in _MAPS:
        count, pos = _read_uint(view, pos, _MAPS[first], end)
        return pos, _fits(2 * count, pos, end), None
    if first in _EXTS:
        length, pos = _read_uint(view, pos, _EXTS[first], end)
        return _ext(view, pos, length, end)
    if first in _FIXEXTS:
        return _ext(view, pos, _FIXEXTS[first], end)
    raise MsgpackLimitError(f"invalid MessagePack byte 0x{first:02x}")


def _ext(view: memoryview, pos: int, length: int, end: int) -> tuple[int, int, int | None]:
    payload_start = _skip(pos, 1, end)  # the type code
    code = view[pos]
    payload_end = _skip(payload_start, length, end)
    if code in NESTED_EXT_CODES:
        return payload_start, 0, payload_end
    return payload_end, 0, None


def _read_uint(view: memoryview, pos: int, size: int, end: int) -> tuple[int, int]:
    after = _skip(pos, size, end)
    return _UINT[size].unpack_from(view, pos)[0], after


def _skip(pos: int, length: int, end: int) -> int:
    if pos + length > end:
        raise MsgpackLimitError("truncated MessagePack")
    return pos + length


def _fits(items: int, pos: int, end: int) -> int:
    """Every item takes at least one byte: a count beyond the bytes left is a lie."""
    if items > end - pos:
        raise MsgpackLimitError(f"MessagePack container claims {items} items in {end - pos} bytes")
    return items


def checking(loads: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``loads`` (hivemind's ``MSGPackSerializer.loads``) behind ``check_msgpack``; ``petals.patches``
    puts it in hivemind's place, which covers our RPC metadata and every DHT code path alike."""

    def bounded_loads(buf: bytes) -> Any:
        try:
            check_msgpack(buf)
        except MsgpackLimitError as error:
            logger.warning("Refused MessagePack from the network: %s", error)
            raise
        return loads(buf)

    return bounded_loads


def make_record_validator():
    """A hivemind ``RecordValidatorBase`` that refuses DHT records whose subkey or value break the limits."""
    from hivemind.dht.validation import RecordValidatorBase

    class BoundedRecordValidator(RecordValidatorBase):
        def validate(self, record) -> bool:
            for part, raw in (("subkey", record.subkey), ("value", record.value)):
                if not raw and part == "subkey":
                    continue  # a whole dictionary value is validated subkey by subkey
                try:
                    check_msgpack(raw)
                except MsgpackLimitError as error:
                    logger.debug("Ignoring a DHT record: its %s is refused (%s)", part, error)
                    return False
            return True

    return BoundedRecordValidator()
