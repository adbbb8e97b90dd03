"""The trust part of ``make reliability`` (issue 24): servers that lie, seeded and bounded.

1. A lying server (in-process, its inference outputs perturbed by a relative 1e-2 on every step)
   among two honest ones of the same blocks: a client with ``verify=1.0`` must catch it and generate
   what local transformers does; the cost of ``verify`` is the per-token time of greedy generation on
   the honest servers at ``verify`` 0, 0.05 and 1, interleaved on one client (the best of 5, as a
   ratio to 0).
2. A throughput liar: announces 1000x the honest server's throughput, sits behind 40 ms of latency
   each way; its share of 100 forwards (routed for throughput) after 10 warm-up forwards, against its
   measured share.
3. Record spam: 200 well-formed records of peers that do not exist under every block key; a fresh
   client's first-token time with and without them.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch
from hivemind.p2p import PeerID

from petals.data_structures import ServerInfo, ServerState, make_uids
from petals.dht import expiration_from_now
from petals.formats.gguf import local_model
from petals.testing.delay_proxy import DelayProxy, free_local_port
from petals.testing.inprocess import InProcessDht, InProcessServer
from petals.testing.liar import make_liar
from petals.testing.swarm import LOOPBACK_CLIENT
from petals.testing.wire_client import WireClient

FRACTIONS = (0.0, 0.05, 1.0)
BLOCKS = ("--block_indices", "0:4", "--torch_dtype", "float32")
FAKE_SERVERS = 200


def _model(model_path: Path, initial_peers, **options):
    import petals

    return petals.AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=initial_peers, **LOOPBACK_CLIENT, **options
    )


@contextlib.contextmanager
def _servers(model_path: Path, *argument_lists: tuple[str, ...]):
    """An in-process bootstrap peer and one server per argument list; yields (initial peers, servers)."""
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        servers = [InProcessServer(model_path, dht.initial_peers, *arguments) for arguments in argument_lists]
        for server in servers:
            server.start(wait=False)
        for server in servers:
            stack.enter_context(server.wait_ready())
        yield dht.initial_peers, servers


def _greedy_seconds(model, ids: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    started = time.perf_counter()
    output = model.generate(ids, **kwargs)
    return (time.perf_counter() - started) / tokens, output


def run_lying_server(model_path: Path, seed: int, tokens: int) -> dict:
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(seed))
    local = local_model(model_path, dtype=torch.float32)
    expected = local.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    report: dict = {"relative_perturbation": 1e-2}
    with _servers(model_path, BLOCKS, BLOCKS, BLOCKS) as (peers, servers):
        costs: dict[float, float] = {}
        model = _model(model_path, peers)
        try:
            _greedy_seconds(model, ids, tokens)  # warm-up: routes, pings, the servers learning thread counts
            for _ in range(5):  # interleaved on one client, so that drift on a shared machine hits all alike
                for fraction in FRACTIONS:
                    model.remote_blocks.manager.config.verify = fraction
                    seconds = _greedy_seconds(model, ids, tokens)[0]
                    costs[fraction] = min(costs.get(fraction, math.inf), seconds)
        finally:
            model.close()
        report["seconds_per_token"] = {str(fraction): round(cost, 4) for fraction, cost in costs.items()}
        report["verify_cost_ratio"] = {str(f): round(costs[f] / costs[0.0], 2) for f in (0.05, 1.0)}
        liar = servers[-1]
        lies = make_liar(liar.server, relative=1e-2, every=1, seed=seed)
        model = _model(model_path, peers, verify=1.0)
        try:
            _, output = _greedy_seconds(model, ids, tokens)
            suspects = model.suspects()
        finally:
            model.close()
    report.update(
        lies_told=len(lies),
        caught=[suspect.peer_id for suspect in suspects] == [liar.peer_id],
        checks_when_caught=suspects[0].checks if suspects else None,
        output_equals_local=bool(torch.equal(output, expected)),
    )
    return report


def run_throughput_liar(model_path: Path, warmup: int = 10, counted: int = 100) -> dict:
    honest_throughput = 2000.0
    private_port = free_local_port()
    with DelayProxy(private_port, delay_ms=40) as proxy:
        liar_args = (
            *BLOCKS,
            "--throughput",
            str(1000 * honest_throughput),
            "--host_maddrs",
            f"/ip4/127.0.0.1/tcp/{private_port}",
            "--announce_maddrs",
            f"/ip4/127.0.0.1/tcp/{proxy.port}",
        )
        honest_args = (*BLOCKS, "--throughput", str(honest_throughput))
        with _servers(model_path, liar_args, honest_args) as (peers, (liar, honest)):
            model = _model(model_path, peers)
            try:
                manager = model.remote_blocks.manager
                liar_id = PeerID.from_base58(liar.peer_id)
                hidden = torch.randn(1, 4, model.config.hidden_size)
                with torch.no_grad():
                    for _ in range(warmup):
                        model.remote_blocks(hidden)
                    before, measured = manager.measurements.samples(liar_id), 0.0
                    for _ in range(counted):
                        measured += manager.measurements.throughput_share(manager.usable_spans(), liar_id)
                        model.remote_blocks(hidden)
                share = (manager.measurements.samples(liar_id) - before) / counted
            finally:
                model.close()
    return {
        "announced_share": round(1000 / 1001, 4),
        "measured_share": round(measured / counted, 4),
        "share": share,
    }


def run_record_spam(model_path: Path, prefix: str) -> dict:
    uids = make_uids(prefix, 0, 4)
    with _servers(model_path, BLOCKS) as (peers, _):
        baseline = _first_token_seconds(model_path, peers)
        spammer = WireClient(peers)
        try:
            fakes = [PeerID(b"\x12\x20" + os.urandom(32)).to_base58() for _ in range(FAKE_SERVERS)]
            stored = spammer.run(
                spammer.node.store_many(
                    [uid for uid in uids for _ in fakes],
                    [_fake_record(len(uids))] * (len(uids) * FAKE_SERVERS),
                    expiration_from_now(120),
                    subkeys=fakes * len(uids),
                )
            )
        finally:
            spammer.close()
        spammed = _first_token_seconds(model_path, peers)
    return {
        "fake_records": sum(bool(ok) for ok in stored.values()),
        "first_token_seconds": round(baseline, 2),
        "first_token_seconds_spammed": round(spammed, 2),
        "delay_seconds": round(spammed - baseline, 2),
    }


def _fake_record(blocks: int) -> tuple:
    info = ServerInfo(
        ServerState.ONLINE,
        throughput=1e6,
        start_block=0,
        end_block=blocks,
        inference_rps=1e6,
        forward_rps=1e6,
        cache_tokens_left=10**9,
    )
    return info.to_tuple()


def _first_token_seconds(model_path: Path, peers) -> float:
    model = _model(model_path, peers)
    try:
        started = time.perf_counter()
        model.generate(torch.tensor([[5, 17, 42, 7]]), max_new_tokens=1, do_sample=False)
        return time.perf_counter() - started
    finally:
        model.close()


def run_trust(model_path: Path, seed: int, tokens: int, prefix: str) -> dict:
    return {
        "lying_server": run_lying_server(model_path, seed, tokens),
        "throughput_liar": run_throughput_liar(model_path),
        "record_spam": run_record_spam(model_path, prefix),
    }


def trust_checks(report: dict) -> list[tuple[str, bool]]:
    lying, throughput, spam = report["lying_server"], report["throughput_liar"], report["record_spam"]
    return [
        ("lying server caught, output equals local", lying["caught"] and lying["output_equals_local"]),
        ("lying server caught within 20 verified steps", (lying["checks_when_caught"] or 99) <= 20),
        (
            "throughput liar gets no more than its measured share",
            throughput["share"] <= throughput["measured_share"] + 0.1,
        ),
        ("record spam delays the first token by at most 5 s", spam["delay_seconds"] <= 5.0),
    ]
