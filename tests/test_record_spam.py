"""Record spam (issue 24, point 4): well-formed server records of peers that do not exist, under every
block key of a model, neither stall a fresh client's first token nor cause an error."""

from __future__ import annotations

import logging
import os
import time

import torch
from hivemind.p2p import PeerID

import petals
from conftest import LOOPBACK_CLIENT, inprocess_swarm
from petals.data_structures import ServerInfo, ServerState, make_uids
from petals.dht import expiration_from_now
from petals.testing.wire_client import WireClient

FAKE_SERVERS = 200
MAX_DELAY = 5.0  # seconds the spam may add to a fresh client's first token (the bound)
UIDS = make_uids("tiny-llama-hf", 0, 4)
PROMPT = torch.tensor([[5, 17, 42, 7]])


def fake_record() -> tuple:
    """As attractive as a record gets: every block, fast, plenty of cache."""
    info = ServerInfo(
        ServerState.ONLINE,
        throughput=1e6,
        start_block=0,
        end_block=len(UIDS),
        version=petals.__version__,
        inference_rps=1e6,
        forward_rps=1e6,
        cache_tokens_left=10**9,
    )
    return info.to_tuple()


def first_token(path, initial_peers) -> tuple[float, torch.Tensor]:
    """Seconds a fresh client takes from ``generate`` to its first new token, and that token."""
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=initial_peers, **LOOPBACK_CLIENT
    )
    try:
        started = time.perf_counter()
        output = model.generate(PROMPT, max_new_tokens=1, do_sample=False)
        return time.perf_counter() - started, output
    finally:
        model.close()


def test_fake_server_records_delay_a_fresh_clients_first_token_by_at_most_5_s(tiny_model_path, caplog):
    path = tiny_model_path("llama")
    with inprocess_swarm(path, "0:4") as (dht, (server,)):
        baseline, expected = first_token(path, dht.initial_peers)
        spammer = WireClient(dht.initial_peers)
        try:
            fakes = [PeerID(b"\x12\x20" + os.urandom(32)).to_base58() for _ in range(FAKE_SERVERS)]
            stored = spammer.run(
                spammer.node.store_many(
                    [uid for uid in UIDS for _ in fakes],
                    [fake_record()] * (len(UIDS) * FAKE_SERVERS),
                    expiration_from_now(120),
                    subkeys=fakes * len(UIDS),
                )
            )
            assert all(stored.values())
            assert all(len(info.servers) == FAKE_SERVERS + 1 for info in spammer.module_infos(UIDS))
        finally:
            spammer.close()
        with caplog.at_level(logging.WARNING, logger="petals"):
            spammed, output = first_token(path, dht.initial_peers)
    assert torch.equal(output, expected)
    assert spammed - baseline <= MAX_DELAY, (
        f"first token: {spammed:.2f} s with the spam, {baseline:.2f} s without"
    )
    # no request failed, no server was banned (other loggers may report objects of earlier tests collected now)
    assert [record.getMessage() for record in caplog.records if record.name.startswith("petals")] == []
