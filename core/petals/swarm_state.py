"""What a swarm looks like right now: which blocks of which models are served, by whom, how well.

``fetch_swarm_state`` reads the ``_petals.models`` index and every block record from the DHT, folds
each server's records into one span (``petals.dht.compute_spans``), dials the ONLINE servers and
the bootstrap peers to see that they answer, and returns a ``SwarmState``. ``SwarmState.to_json``
gives the original Petals health monitor's ``/api/v1/state`` shape, so tools written for
health.petals.dev read it unchanged. ``petals health`` and ``petals monitor`` both show this state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.dht import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from petals.data_structures import ModelInfo, RemoteSpanInfo, ServerState, make_uids
from petals.dht import compute_spans, get_model_index, get_remote_module_infos

RPC_INFO = "TransformerConnectionHandler.rpc_info"
REACH_TIMEOUT = 5.0  # seconds to wait for a peer to answer before calling it unreachable
MIN_BLOCKS_FOR_PUBLIC_NAME = 10  # the original monitor credits a public name only for this many blocks
PROTOCOL_NOT_SUPPORTED = re.compile(r"protocols? not supported")  # libp2p's answer of a peer without the RPC


class UnknownModelError(LookupError):
    """The model asked for is not announced in the swarm's ``_petals.models`` index."""


@dataclass
class ServerRow:
    """One server of one model: its span, its state as the monitor sees it, and pings it received."""

    span: RemoteSpanInfo
    state: str  # "online", "joining", "offline", or "unreachable" (announced ONLINE but did not answer)
    pings_to_me: dict[str, float]

    @property
    def peer_id(self) -> PeerID:
        return self.span.peer_id

    @property
    def short_peer_id(self) -> str:
        return "..." + self.peer_id.to_base58()[-6:]

    @property
    def cache_tokens_left_per_block(self) -> int | None:
        """Tokens of keys and values one block can still hold (announced for the span, K and V counted apart)."""
        tokens = self.span.server_info.cache_tokens_left
        return None if tokens is None else tokens // (self.span.length * 2)

    @property
    def cache_memory(self) -> str | None:
        """The server's KV cache in MiB: what sessions hold of its budget, and by which cache kinds."""
        info = self.span.server_info
        if info.cache_bytes is None:
            return None
        held = {kind: nbytes for kind, nbytes in (info.cache_bytes_held or {}).items() if nbytes}
        text = f"{sum(held.values()) / 2**20:.1f} of {info.cache_bytes / 2**20:.1f} MiB"
        if held:
            text += (
                " ("
                + ", ".join(
                    f"{kind.replace('_', ' ')} {nbytes / 2**20:.1f}" for kind, nbytes in sorted(held.items())
                )
                + ")"
            )
        return text

    @property
    def shows_public_name(self) -> bool:
        return self.state == "online" and self.span.length >= MIN_BLOCKS_FOR_PUBLIC_NAME


@dataclass
class ModelReport:
    dht_prefix: str
    info: ModelInfo
    rows: list[ServerRow]

    @property
    def name(self) -> str:
        return model_name(self.dht_prefix, self.info)

    @property
    def num_blocks(self) -> int:
        return self.info.num_blocks

    def servers_per_block(self, state: str = "online") -> list[int]:
        """How many servers in ``state`` cover each block."""
        counts = [0] * self.num_blocks
        for row in self.rows:
            if row.state == state:
                for index in range(row.span.start, row.span.end):
                    counts[index] += 1
        return counts

    def missing_ranges(self) -> list[tuple[int, int]]:
        """Runs ``[start, end)`` of blocks that no ONLINE server covers."""
        ranges: list[tuple[int, int]] = []
        for index, count in enumerate(self.servers_per_block()):
            if count:
                continue
            if ranges and ranges[-1][1] == index:
                ranges[-1] = (ranges[-1][0], index + 1)
            else:
                ranges.append((index, index + 1))
        return ranges

    @property
    def healthy(self) -> bool:
        return not self.missing_ranges()


@dataclass
class SwarmState:
    models: list[ModelReport]
    bootstrap_states: list[str]  # "online" or "unreachable", one per distinct initial peer
    reachability_issues: dict[PeerID, str]
    peer_addresses: dict[PeerID, list[str]]
    last_updated: float  # unix time
    update_period: float
    update_duration: float
    top_contributors: Counter = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        """The original health monitor's ``/api/v1/state`` document (JSON-ready: no NaN or infinity)."""
        return _finite(
            {
                "bootstrap_states": self.bootstrap_states,
                "top_contributors": dict(self.top_contributors),
                "model_reports": [self._model_json(report) for report in self.models],
                "reachability_issues": [
                    {"peer_id": peer_id.to_base58(), "err": error}
                    for peer_id, error in sorted(self.reachability_issues.items())
                ],
                "last_updated": self.last_updated,
                "update_period": self.update_period,
                "update_duration": self.update_duration,
            }
        )

    def _model_json(self, report: ModelReport) -> dict[str, Any]:
        return {
            "name": report.name,
            "short_name": report.name.split("/")[-1],
            "state": "healthy" if report.healthy else "broken",
            "server_rows": [self._row_json(row) for row in report.rows],
            "num_blocks": report.num_blocks,
            "repository": report.info.repository,
            "dht_prefix": report.dht_prefix,
            "official": False,  # the original marks its hand-picked public models; a swarm has none
            "limited": False,
        }

    def _row_json(self, row: ServerRow) -> dict[str, Any]:
        info = dataclasses.asdict(row.span.server_info)
        info["state"] = row.span.state.name.lower()
        info["adapters"] = list(row.span.server_info.adapters)
        peer_id = row.peer_id.to_base58()
        document = {
            "short_peer_id": row.short_peer_id,
            "peer_id": peer_id,
            "peer_ip_info": {"location": {}, "multiaddrs": self.peer_addresses.get(row.peer_id, [])},
            "show_public_name": row.shows_public_name,
            "state": row.state,
            "span": {"peer_id": peer_id, "start": row.span.start, "end": row.span.end, "server_info": info},
            "adapters": [{"name": name, "short_name": name.split("/")[-1]} for name in info["adapters"]],
            "pings_to_me": row.pings_to_me,
        }
        if row.cache_tokens_left_per_block is not None:
            document["cache_tokens_left_per_block"] = row.cache_tokens_left_per_block
        if row.cache_memory is not None:
            document["cache_memory"] = row.cache_memory
        return document


async def fetch_swarm_state(
    node: DHTNode,
    p2p: P2P,
    initial_peers: Sequence[str],
    *,
    model: str | None = None,
    update_period: float = 0.0,
    reach_timeout: float = REACH_TIMEOUT,
) -> SwarmState:
    """Read the DHT and dial the peers; ``model`` (a dht_prefix or a name) limits it to one model."""
    started = time.perf_counter()
    index = await get_model_index(node)
    prefixes = _selected_prefixes(index, model)
    reports = []
    for prefix in prefixes:
        infos = await get_remote_module_infos(
            node, make_uids(prefix, 0, index[prefix].num_blocks), latest=True
        )
        spans = compute_spans(infos, min_state=ServerState.OFFLINE)
        reports.append(ModelReport(prefix, index[prefix], [_row(peer, spans) for peer in sorted(spans)]))

    bootstrap_ids = list(dict.fromkeys(PeerID.from_base58(Multiaddr(peer)["p2p"]) for peer in initial_peers))
    issues = await _dial_and_mark_unreachable(bootstrap_ids, reports, p2p, reach_timeout)
    return SwarmState(
        models=reports,
        bootstrap_states=["unreachable" if peer_id in issues else "online" for peer_id in bootstrap_ids],
        reachability_issues=issues,
        peer_addresses={info.peer_id: [str(addr) for addr in info.addrs] for info in await p2p.list_peers()},
        last_updated=time.time(),
        update_period=update_period,
        update_duration=time.perf_counter() - started,
        top_contributors=_top_contributors(reports),
    )


async def _dial_and_mark_unreachable(
    peer_ids: Sequence[PeerID], reports: Sequence[ModelReport], p2p: P2P, timeout: float
) -> dict[PeerID, str]:
    """Dial ``peer_ids`` and every ONLINE server; those that do not answer become "unreachable"."""
    online = {row.peer_id for report in reports for row in report.rows if row.state == "online"}
    checked = list(dict.fromkeys([*peer_ids, *sorted(online)]))
    errors = await asyncio.gather(*(reach_error(p2p, peer_id, timeout) for peer_id in checked))
    issues = {peer_id: error for peer_id, error in zip(checked, errors, strict=True) if error is not None}
    for report in reports:
        for row in report.rows:
            if row.state == "online" and row.peer_id in issues:
                row.state = "unreachable"
    return issues


def _selected_prefixes(index: dict[str, ModelInfo], model: str | None) -> list[str]:
    if model is None:
        return sorted(index, key=lambda prefix: (-index[prefix].num_blocks, prefix))
    for prefix, info in index.items():
        if model in (prefix, model_name(prefix, info)):
            return [prefix]
    announced = ", ".join(sorted(index)) or "none"
    raise UnknownModelError(
        f"model {model!r} is not announced in this swarm's _petals.models index (announced: {announced}); "
        "pass a dht_prefix or a model name from that list, or none to see every model"
    )


def model_name(dht_prefix: str, info: ModelInfo) -> str:
    """The repository path for hub models (as the original monitor names them), else the dht_prefix."""
    return info.repository.removeprefix("https://huggingface.co/") if info.repository else dht_prefix


def _row(peer_id: PeerID, spans: dict[PeerID, RemoteSpanInfo]) -> ServerRow:
    """A server's row; ``pings_to_me`` are the round trips other servers of the model measured to it."""
    target = peer_id.to_base58()
    pings = {
        origin.to_base58(): span.server_info.next_pings[target]
        for origin, span in spans.items()
        if span.server_info.next_pings and target in span.server_info.next_pings
    }
    return ServerRow(spans[peer_id], spans[peer_id].state.name.lower(), pings)


def _top_contributors(reports: Sequence[ModelReport]) -> Counter:
    contributors: Counter = Counter()
    for report in reports:
        for row in report.rows:
            if row.shows_public_name and row.span.server_info.public_name:
                contributors[row.span.server_info.public_name] += row.span.length
    return contributors


async def reach_error(p2p: P2P, peer_id: PeerID, timeout: float = REACH_TIMEOUT) -> str | None:
    """Dial ``peer_id`` and call its ``rpc_info``; ``None`` if it answered, else what went wrong.

    A peer without Petals' handler (a bootstrap DHT peer, a server still loading) answers "protocol
    not supported": it is reachable.
    """
    try:
        await asyncio.wait_for(
            p2p.call_protobuf_handler(peer_id, RPC_INFO, runtime_pb2.ExpertUID(), runtime_pb2.ExpertInfo),
            timeout,
        )
    except TimeoutError:
        return f"no answer within {timeout:.0f} s: a firewall or NAT may be blocking connections"
    except Exception as error:
        message = str(error) or repr(error)
        return None if PROTOCOL_NOT_SUPPORTED.search(message) else message
    return None


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by ``None`` (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
