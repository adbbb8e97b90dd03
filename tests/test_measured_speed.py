"""Claims are checked against measurements: a server's announced speed counts only until the client
has timed it, and a server never timed cannot hold a step for the whole ``request_timeout``."""

from __future__ import annotations

import contextlib
import signal
import time

import torch
from hivemind.p2p import PeerID
from transformers import AutoModelForCausalLM, StoppingCriteria

import petals
from conftest import LOOPBACK_CLIENT, swarm_with_processes
from petals.server.server import READY_MESSAGE
from petals.testing.delay_proxy import DelayProxy, free_local_port
from petals.testing.inprocess import InProcessDht, InProcessServer
from petals.testing.swarm import start_server

HONEST_THROUGHPUT = 2000.0
LIAR_THROUGHPUT = 1000 * HONEST_THROUGHPUT
WARMUP_STEPS = 10
COUNTED_FORWARDS = 100


def test_a_throughput_liar_gets_no_more_than_its_measured_share(tiny_model_path):
    """Two servers of blocks 0:4; the liar announces 1000x the other's throughput but sits behind 40 ms
    of latency each way. After ``WARMUP_STEPS`` forwards, forwards (routed for
    maximum throughput) go to it no more often than its measured throughput's share."""
    path = tiny_model_path("llama")
    common = ("--block_indices", "0:4", "--torch_dtype", "float32")
    private_port = free_local_port()
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        proxy = stack.enter_context(DelayProxy(private_port, delay_ms=40))
        liar = InProcessServer(
            path,
            dht.initial_peers,
            *common,
            "--throughput",
            str(LIAR_THROUGHPUT),
            "--host_maddrs",
            f"/ip4/127.0.0.1/tcp/{private_port}",
            "--announce_maddrs",
            f"/ip4/127.0.0.1/tcp/{proxy.port}",
        )
        honest = InProcessServer(path, dht.initial_peers, *common, "--throughput", str(HONEST_THROUGHPUT))
        stack.enter_context(liar.start())
        stack.enter_context(honest.start())
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        stack.callback(model.close)
        manager = model.remote_blocks.manager
        liar_id, honest_id = PeerID.from_base58(liar.peer_id), PeerID.from_base58(honest.peer_id)
        hidden = torch.randn(1, 4, model.config.hidden_size)
        with torch.no_grad():
            for _ in range(WARMUP_STEPS):
                model.remote_blocks(hidden)
            assert manager.measurements.samples(liar_id) > 0, "the liar was never routed to"
            before, measured_shares = manager.measurements.samples(liar_id), []
            for _ in range(COUNTED_FORWARDS):
                measured_shares.append(manager.measurements.throughput_share(manager.usable_spans(), liar_id))
                model.remote_blocks(hidden)
        liar_share = (manager.measurements.samples(liar_id) - before) / COUNTED_FORWARDS
        measured_share = sum(measured_shares) / COUNTED_FORWARDS  # what routing was told, forward by forward
        assert manager.measurements.measured_throughput(liar_id) < LIAR_THROUGHPUT / 100
        assert honest_id in {span.peer_id for span in manager.usable_spans()}
        assert liar_share <= measured_share + 0.1, (liar_share, measured_share)
        assert liar_share < 0.5, (liar_share, measured_share)  # it announced 99.95% of the throughput


NEW_TOKENS = 24
FAULT_AFTER = 6
GENERATION_LIMIT = 30.0


class HangTheRange(StoppingCriteria):
    """After ``FAULT_AFTER`` tokens: starts a fresh server for blocks 2:4 and waits until it is ONLINE
    (time not counted), then SIGSTOPs both servers the client knows for blocks 2:4."""

    def __init__(self, path, dht, servers, stack: contextlib.ExitStack, prompt_length: int) -> None:
        self.path, self.dht, self.servers, self.stack = path, dht, servers, stack
        self.prompt_length = prompt_length
        self.hung: list = []
        self.fresh = None
        self.setup_seconds = 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.fresh is None and input_ids.shape[1] - self.prompt_length == FAULT_AFTER:
            started = time.perf_counter()
            self.fresh = self.stack.enter_context(
                start_server(
                    self.path,
                    self.dht.initial_peers,
                    "--block_indices",
                    "2:4",
                    "--torch_dtype",
                    "float32",
                    timeout=180,
                )
            )
            self.fresh.wait_for_log(READY_MESSAGE, timeout=180)
            self.hung = self.servers[1:]
            for server in self.hung:
                server.process.send_signal(signal.SIGSTOP)
            self.setup_seconds = time.perf_counter() - started
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_both_servers_of_a_range_hung_and_a_fresh_one_joining(tiny_model_path):
    """The client has timed one server of blocks 2:4 and never the other; both hang. The never-timed one
    gets a deadline from its announced speed bounded by the timed one's latency (not the 180 s
    ``request_timeout``), so the generation moves on to the fresh server within seconds."""
    path = tiny_model_path("llama")
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(11))
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(ids, **greedy)
    swarm = swarm_with_processes(path, "0:2", "2:4", "2:4", processes=2)  # those of 2:4 hang
    with swarm as (dht, servers), contextlib.ExitStack() as stack:
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, update_period=600, **LOOPBACK_CLIENT
        )
        criteria = HangTheRange(path, dht, servers, stack, ids.shape[1])
        try:
            started = time.perf_counter()
            output = model.generate(ids, stopping_criteria=[criteria], **greedy)
            seconds = time.perf_counter() - started - criteria.setup_seconds
            banned = {str(peer) for peer in model.remote_blocks.manager.bans}
            fresh_steps = model.remote_blocks.manager.measurements.samples(
                PeerID.from_base58(criteria.fresh.peer_id)
            )
        finally:
            model.close()
            for server in criteria.hung:
                server.process.send_signal(signal.SIGCONT)
        assert criteria.fresh is not None, "the fault was never applied"
        assert fresh_steps > 0, "the fresh server was never used"
        assert {server.peer_id for server in criteria.hung} <= banned, "a hung server was never tried"
        assert torch.equal(output, expected)
        print(f"{NEW_TOKENS} tokens in {seconds:.1f} s besides the setup")
        assert seconds < GENERATION_LIMIT, f"{NEW_TOKENS} tokens took {seconds:.1f} s besides the setup"
