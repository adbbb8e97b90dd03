"""Malformed inputs an attacker can send, shared by the tests and ``make reliability``."""

from __future__ import annotations

import msgpack

TUPLE_EXT_CODE = 0x40  # hivemind's MSGPackSerializer packs a tuple as this ext type holding a list


def nested_tuples(depth: int = 200) -> bytes:
    """``((((...))))`` ``depth`` levels deep as hivemind packs tuples: 938 bytes at depth 200.

    hivemind's decoder recurses through the C unpacker once per level; unchecked, this payload
    overflows the C stack (SIGSEGV) of any process that decodes it.
    """
    inner = msgpack.packb([], use_bin_type=True)
    for _ in range(depth - 1):
        inner = msgpack.packb([msgpack.ExtType(TUPLE_EXT_CODE, inner)], use_bin_type=True)
    return msgpack.packb(msgpack.ExtType(TUPLE_EXT_CODE, inner), use_bin_type=True)


def nested_metadata(depth: int = 200) -> bytes:
    """Request metadata (a dict, as Petals sends) whose ``args_structure`` is ``nested_tuples(depth)``."""
    return b"\x81" + msgpack.packb("args_structure") + nested_tuples(depth)
