"""The records servers publish in the DHT, and block uids: one home for their wire encoding.

A server announces itself under key ``"{dht_prefix}.{i}"`` for every block ``i`` it hosts, with its
base58 peer id as the subkey and ``ServerInfo.to_tuple()`` as the value:
``(state: int, throughput: float, info: dict)``. The dict carries every other ``ServerInfo`` field
(``None`` included), exactly as Petals 2.x servers write it, so stock Petals clients parse ours.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from hivemind.p2p import PeerID

from petals.constants import CHAIN_DELIMITER, UID_DELIMITER

ModuleUID = str


class ServerState(IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


class RecordError(ValueError):
    """A DHT record that does not follow the Petals schema."""


def make_uid(dht_prefix: str, block_index: int) -> ModuleUID:
    return f"{dht_prefix}{UID_DELIMITER}{block_index}"


def make_uids(dht_prefix: str, start: int, end: int) -> list[ModuleUID]:
    return [make_uid(dht_prefix, index) for index in range(start, end)]


def parse_uid(uid: ModuleUID) -> tuple[str, int]:
    """``"prefix.7"`` → ``("prefix", 7)``; anything else is a ``ValueError`` naming the uid."""
    prefix, delimiter, index = uid.rpartition(UID_DELIMITER)
    if (
        not delimiter
        or not prefix
        or UID_DELIMITER in prefix
        or CHAIN_DELIMITER in uid
        or not index.isdigit()
    ):
        raise ValueError(f"invalid block uid {uid!r}: expected '<dht_prefix>{UID_DELIMITER}<block index>'")
    return prefix, int(index)


def parse_uid_chain(chain: str) -> list[ModuleUID]:
    """A span's uids, sent as one string joined by spaces."""
    return chain.split(CHAIN_DELIMITER) if chain else []


# field name -> (accepted types, extra check); bool is excluded from int/float as pydantic's strict mode does
_INFO_FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "start_block": ((int,), lambda v: v >= 0),
    "end_block": ((int,), lambda v: v >= 0),
    "public_name": ((str,), None),
    "version": ((str,), None),
    "network_rps": ((float,), lambda v: v >= 0 and math.isfinite(v)),
    "forward_rps": ((float,), lambda v: v >= 0 and math.isfinite(v)),
    "inference_rps": ((float,), lambda v: v >= 0 and math.isfinite(v)),
    "adapters": ((tuple, list), lambda v: all(isinstance(name, str) for name in v)),
    "torch_dtype": ((str,), None),
    "quant_type": ((str,), None),
    "using_relay": ((bool,), None),
    "cache_tokens_left": ((int,), lambda v: v >= 0),
    "next_pings": (
        (dict,),
        lambda v: all(isinstance(k, str) and isinstance(x, float) and x >= 0 for k, x in v.items()),
    ),
    "weight_bytes": ((int,), lambda v: v >= 0),
    "dequantized_from": ((str,), None),
    "packed_as": ((str,), None),
    "cache_bytes": ((int,), lambda v: v >= 0),
    "cache_bytes_held": (
        (dict,),
        lambda v: all(isinstance(k, str) and type(x) is int and x >= 0 for k, x in v.items()),
    ),
    "cache_pages": (
        (dict,),
        lambda v: all(isinstance(k, str) and type(x) is int and x >= 0 for k, x in v.items()),
    ),
    "sessions_preempted": ((int,), lambda v: v >= 0),
}


@dataclass
class ServerInfo:
    """What a server says about itself in every block record (Petals' ``ServerInfo`` fields)."""

    state: ServerState
    throughput: float
    start_block: int | None = None
    end_block: int | None = None
    public_name: str | None = None
    version: str | None = None
    network_rps: float | None = None
    forward_rps: float | None = None
    inference_rps: float | None = None
    adapters: tuple[str, ...] = ()
    torch_dtype: str | None = None
    quant_type: str | None = None
    using_relay: bool | None = None
    cache_tokens_left: int | None = None
    next_pings: dict[str, float] | None = None
    weight_bytes: int | None = None  # petals-core extension: the hosted blocks' weights, after conversion
    # petals-core extension: the checkpoint's quant_method when its weights were dequantized at load
    dequantized_from: str | None = None
    # petals-core extension: the checkpoint's stored format when its weights are served in it, packed
    packed_as: str | None = None
    # petals-core extensions: the KV-cache budget in bytes, and what sessions hold of it by cache kind
    cache_bytes: int | None = None
    cache_bytes_held: dict[str, int] | None = None
    # petals-core extensions: the cache's pages by use (live, kept: lent by idle and kept sessions, free),
    # and how many live sessions gave their pages to older ones since the server started
    cache_pages: dict[str, int] | None = None
    sessions_preempted: int | None = None

    def to_tuple(self) -> tuple[int, float, dict[str, Any]]:
        info = dataclasses.asdict(self)
        del info["state"], info["throughput"]
        info["adapters"] = tuple(self.adapters)
        return int(self.state), float(self.throughput), info

    @classmethod
    def from_tuple(cls, source: Any) -> ServerInfo:
        """Parse a record value; unknown info keys are ignored, missing ones take defaults."""
        if not isinstance(source, tuple | list) or len(source) < 2:
            raise RecordError(f"expected (state, throughput, info), got {source!r}")
        state, throughput, info = source[0], source[1], source[2] if len(source) > 2 else {}
        if type(state) is not int or state not in ServerState._value2member_map_:
            raise RecordError(f"invalid server state {state!r}")
        if type(throughput) is not float or not (throughput >= 0 and math.isfinite(throughput)):
            raise RecordError(f"throughput must be a finite float >= 0, got {throughput!r}")
        if not isinstance(info, dict):
            raise RecordError(f"server info must be a dict, got {type(info).__name__}")
        fields = {name: _checked_info_field(name, info[name]) for name in _INFO_FIELDS if name in info}
        if "adapters" in fields:
            fields["adapters"] = tuple(fields["adapters"] or ())
        return cls(ServerState(state), throughput, **fields)


def _checked_info_field(name: str, value: Any) -> Any:
    types, check = _INFO_FIELDS[name]
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise RecordError(f"server info field {name!r} has the wrong type: {value!r}")
    if check is not None and not check(value):
        raise RecordError(f"server info field {name!r} is out of range: {value!r}")
    return value


@dataclass(frozen=True)
class ModelInfo:
    """The model index entry (key ``_petals.models``, subkey = dht_prefix)."""

    num_blocks: int
    repository: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"num_blocks": self.num_blocks, "repository": self.repository}

    @classmethod
    def from_dict(cls, source: Any) -> ModelInfo:
        if not isinstance(source, Mapping):
            raise RecordError(f"model info must be a dict, got {source!r}")
        num_blocks, repository = source.get("num_blocks"), source.get("repository")
        if type(num_blocks) is not int or num_blocks < 1:
            raise RecordError(f"model info num_blocks must be an int >= 1, got {num_blocks!r}")
        if repository is not None and not isinstance(repository, str):
            raise RecordError(f"model info repository must be a str or None, got {repository!r}")
        return cls(num_blocks, repository)


@dataclass
class RemoteModuleInfo:
    """Every server announcing one block uid."""

    uid: ModuleUID
    servers: dict[PeerID, ServerInfo] = field(default_factory=dict)


@dataclass
class RemoteSpanInfo:
    """A run of consecutive blocks ``[start, end)`` one server hosts (indices relative to the query)."""

    peer_id: PeerID
    start: int
    end: int
    server_info: ServerInfo

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def state(self) -> ServerState:
        return self.server_info.state

    @property
    def throughput(self) -> float:
        return self.server_info.throughput
