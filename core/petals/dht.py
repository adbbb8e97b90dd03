"""Reading and writing server records in the hivemind DHT (the schema lives in ``data_structures``).

Every function takes a running ``hivemind.dht.DHTNode``, so servers and clients use them from their
own asyncio loop without a forked ``hivemind.DHT`` process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hivemind.dht import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from petals.bounded_msgpack import make_record_validator
from petals.constants import MODEL_INDEX_KEY
from petals.data_structures import (
    ModelInfo,
    ModuleUID,
    RecordError,
    RemoteModuleInfo,
    RemoteSpanInfo,
    ServerInfo,
    ServerState,
    parse_uid,
)
from petals.membership import PrivateSwarmDetector, SwarmMembership, tolerating_revoked

logger = logging.getLogger(__name__)


async def create_node(
    p2p: P2P,
    initial_peers: Sequence[str],
    membership: SwarmMembership | None = None,
    outsider: PrivateSwarmDetector | None = None,
    **kwargs,
) -> DHTNode:
    """A ``DHTNode`` on ``p2p`` that neither stores nor returns records our decoder would refuse, nor,
    in a private swarm, records that no certified server signed; outside one (no ``membership``), the
    ``outsider`` detector (or a new one) says once that a private swarm's records came."""
    validators = [make_record_validator()]
    validators.append(membership.validator if membership is not None else outsider or PrivateSwarmDetector())
    return await DHTNode.create(
        p2p=p2p,
        initial_peers=list(initial_peers),
        record_validator=CompositeValidator(validators),
        **kwargs,
    )


async def declare_active_modules(
    node: DHTNode, uids: Sequence[ModuleUID], server_info: ServerInfo, expiration_time: float
) -> dict[ModuleUID, bool]:
    """Store this peer's record under every uid; returns which stores succeeded."""
    for uid in uids:
        parse_uid(uid)
    subkey = node.peer_id.to_base58()
    value = server_info.to_tuple()
    return await node.store_many(
        keys=list(uids),
        values=[value] * len(uids),
        expiration_time=expiration_time,
        subkeys=[subkey] * len(uids),
    )


async def declare_model(
    node: DHTNode, dht_prefix: str, model_info: ModelInfo, expiration_time: float
) -> bool:
    """Add the model to the ``_petals.models`` index (skipped for prefixes starting with "_", as Petals does)."""
    if dht_prefix.startswith("_"):
        return False
    return await node.store(MODEL_INDEX_KEY, model_info.to_dict(), expiration_time, subkey=dht_prefix)


async def get_remote_module_infos(
    node: DHTNode, uids: Sequence[ModuleUID], *, latest: bool = False, active_adapter: str | None = None
) -> list[RemoteModuleInfo]:
    """Every server announcing each uid; malformed records are skipped with a warning.

    ``latest`` traverses the DHT for the freshest records instead of accepting any unexpired one.
    """
    with tolerating_revoked():  # a revoked server's record must not hide the others: readers filter it
        found = await node.get_many(list(uids), sufficient_expiration_time=float("inf") if latest else None)
    infos = []
    for uid in uids:
        module_info = RemoteModuleInfo(uid)
        entry = found.get(uid)
        records = entry.value if entry is not None else {}
        if not isinstance(records, dict):
            logger.warning(
                "DHT key %r holds %r instead of per-server records; ignored", uid, type(records).__name__
            )
            records = {}
        for subkey, record in records.items():
            try:
                peer_id = PeerID.from_base58(subkey)
                server_info = ServerInfo.from_tuple(record.value)
            except (RecordError, ValueError, TypeError) as error:
                logger.warning("Ignoring a malformed record for %s from %r: %s", uid, subkey, error)
                continue
            if active_adapter and active_adapter not in server_info.adapters:
                continue
            module_info.servers[peer_id] = server_info
        infos.append(module_info)
    return infos


async def get_model_index(node: DHTNode) -> dict[str, ModelInfo]:
    """The ``_petals.models`` index: dht_prefix → ModelInfo."""
    with tolerating_revoked():
        entry = await node.get(MODEL_INDEX_KEY, latest=True)
    models = {}
    for prefix, record in (
        entry.value if entry is not None and isinstance(entry.value, dict) else {}
    ).items():
        try:
            models[prefix] = ModelInfo.from_dict(record.value)
        except RecordError as error:
            logger.warning("Ignoring a malformed model index entry %r: %s", prefix, error)
    return models


def compute_spans(
    module_infos: Sequence[RemoteModuleInfo], *, min_state: ServerState
) -> dict[PeerID, RemoteSpanInfo]:
    """One span per server over the queried blocks (indices relative to ``module_infos[0]``).

    A record carrying ``start_block``/``end_block`` gives the span directly (clamped to the query);
    otherwise the span grows over consecutive records. Records below ``min_state`` are ignored, and a
    server's higher-state record wins over a lower one.
    """
    if not module_infos:
        return {}
    _, first_block = parse_uid(module_infos[0].uid)
    num_blocks = len(module_infos)
    spans: dict[PeerID, RemoteSpanInfo] = {}
    for index, module_info in enumerate(module_infos):
        for peer_id, server_info in module_info.servers.items():
            if server_info.state < min_state:
                continue
            span = spans.get(peer_id)
            if span is None or server_info.state > span.state:
                start, end = index, index + 1
                if server_info.start_block is not None and server_info.end_block is not None:
                    start = max(server_info.start_block - first_block, 0)
                    end = min(server_info.end_block - first_block, num_blocks)
                spans[peer_id] = RemoteSpanInfo(peer_id, start, max(end, start + 1), server_info)
            elif span.end == index and server_info.start_block is None:
                span.end = index + 1
    return spans


def expiration_from_now(seconds: float) -> float:
    return get_dht_time() + seconds
