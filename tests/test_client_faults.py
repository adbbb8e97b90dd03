"""Hung and half-dead servers are routed around within seconds, one model serves many threads, and
nobody is banned for the client's own mistakes."""

from __future__ import annotations

import signal
import threading
import time

import psutil
import pytest
import torch
from hivemind.p2p import PeerID
from transformers import AutoModelForCausalLM, StoppingCriteria

import petals
from conftest import LOOPBACK_CLIENT, running_swarm, swarm_with_processes
from petals.client.inference_session import SessionCancelled
from petals.client.measurements import ServerMeasurements
from petals.client.routing import RequestRefused
from petals.data_structures import RemoteSpanInfo, ServerInfo, ServerState

NEW_TOKENS = 16
FAULT_AFTER = 6
RECOVERY_LIMIT = 10.0  # seconds from the fault to the next token


def prompt(seed: int = 7, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(seed))


GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


class FaultAfter(StoppingCriteria):
    """After ``FAULT_AFTER`` new tokens, applies ``fault`` to the server serving blocks 2:4 and
    records how long the next token took."""

    def __init__(self, model, servers, prompt_length: int, fault) -> None:
        self.model, self.servers, self.prompt_length, self.fault = model, servers, prompt_length, fault
        self.faulted = self.fault_time = self.recovery = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_length
        if self.faulted is None and generated == FAULT_AFTER:
            route = self.model.remote_blocks.active_session.route
            (peer_id,) = {str(span.peer_id) for span in route if span.start == 2}
            self.faulted = next(server for server in self.servers if server.peer_id == peer_id)
            self.fault(self.faulted)
            self.fault_time = time.monotonic()
        elif self.faulted is not None and self.recovery is None:
            self.recovery = time.monotonic() - self.fault_time
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def stop_python(server) -> None:
    server.process.send_signal(signal.SIGSTOP)


def kill_python_only(server) -> None:
    """kill -9 of the server's Python process; its p2p daemon lives on (and is reaped by the test)."""
    server.orphans = psutil.Process(server.pid).children(recursive=True)
    server.process.kill()
    server.process.wait()


@pytest.mark.parametrize("fault", [stop_python, kill_python_only], ids=["SIGSTOP", "kill-9-python"])
def test_a_hung_or_half_dead_server_is_routed_around_quickly(tiny_model_path, fault):
    path = tiny_model_path("llama")
    ids = prompt()
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = local.generate(ids, **GREEDY)
    with swarm_with_processes(path, "0:2", "2:4", "2:4", processes=2) as (dht, servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        criteria = FaultAfter(model, servers, ids.shape[1], fault)
        try:
            output = model.generate(ids, stopping_criteria=[criteria], **GREEDY)
        finally:
            model.close()
            if criteria.faulted is not None:
                if criteria.faulted.process.poll() is None:
                    criteria.faulted.process.send_signal(signal.SIGCONT)
                for orphan in getattr(criteria.faulted, "orphans", []):
                    if orphan.is_running():
                        orphan.kill()
        assert criteria.faulted is not None, "the fault was never applied"
        assert torch.equal(output, expected)
        assert criteria.recovery < RECOVERY_LIMIT, f"next token after {criteria.recovery:.1f} s"


def _span(peer: PeerID, start: int, end: int, throughput: float) -> RemoteSpanInfo:
    return RemoteSpanInfo(peer, start, end, ServerInfo(ServerState.ONLINE, throughput, start, end))


def test_deadlines_follow_observed_latency_and_announced_speed():
    deadlines = ServerMeasurements(floor=2.0, ceiling=180.0, factor=10.0)
    timed = _span(PeerID(b"\x00" * 34), 0, 2, throughput=100.0)
    # never timed, nobody else timed: what the announced throughput says (512 tokens, 2 blocks: 6.8 s)
    assert deadlines.deadline(timed, 512) == pytest.approx(10 * 512 * 2 / (100.0 * 1.5))
    assert deadlines.deadline(_span(timed.peer_id, 0, 2, throughput=0.0), 512) == 180.0  # nothing known
    for _ in range(5):
        deadlines.observe(timed, tokens=1, seconds=0.5)
    assert deadlines.deadline(timed, 1) == pytest.approx(5.0)
    assert deadlines.deadline(timed, 8) == pytest.approx(40.0)  # 8x the tokens of its usual steps
    assert deadlines.deadline(timed, 10_000) == 180.0
    fast = _span(PeerID(b"\x01" * 34), 2, 4, throughput=100.0)
    deadlines.observe(fast, tokens=1, seconds=0.001)
    assert deadlines.deadline(fast, 1) == 2.0  # the floor
    # a fresh server of the timed one's blocks: its announced slowness is bounded by the timed one
    fresh = _span(PeerID(b"\x02" * 34), 0, 2, throughput=1e-3)
    assert deadlines.deadline(fresh, 1) == pytest.approx(5.0)
    assert deadlines.deadline(_span(fresh.peer_id, 0, 2, throughput=0.0), 8) == pytest.approx(40.0)
    assert deadlines.deadline(fresh, 1, replaceable=False) == 180.0  # nowhere else to go: no hurry
    assert deadlines.deadline(timed, 1, replaceable=False) == 180.0  # timed too: a stall is waited out


@pytest.fixture(scope="module")
def shared_model(tiny_model_path):
    path = tiny_model_path("llama")
    with running_swarm(path, "0:2", "2:4", server_args=("--inference_max_length", "64")) as (dht, servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        yield model, servers
        model.close()


def test_one_model_serves_many_threads(shared_model):
    model, _ = shared_model
    prompts = [prompt(seed, length=3 + seed % 5) for seed in range(16)]
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    solo = [model.generate(ids, **kwargs) for ids in prompts]
    results: list[torch.Tensor | BaseException | None] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def generate(index: int) -> None:
        start.wait()
        try:
            results[index] = model.generate(prompts[index], **kwargs)
        except BaseException as error:  # reported below, with the others
            results[index] = error

    threads = [threading.Thread(target=generate, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    errors = [result for result in results if not isinstance(result, torch.Tensor)]
    assert not errors, errors
    assert all(torch.equal(result, expected) for result, expected in zip(results, solo, strict=True))
    assert not model.remote_blocks.manager.bans


STALL = 7.0  # seconds: longer than the floor of a timed server's step deadline (min_step_timeout, 5 s)


def test_a_stall_of_the_only_server_is_waited_out_and_bans_nobody(shared_model):
    """The only server of blocks 2:4, timed by earlier steps, stops for longer than its usual deadline:
    the step waits for it (the only server always gets ``request_timeout``) on the same server sessions,
    with no failover, and nobody is banned."""
    model, servers = shared_model
    hidden_size = model.config.hidden_size
    stalled = servers[1]
    with model.inference_session(max_length=16) as session:
        for _ in range(4):
            session.step(torch.randn(1, 1, hidden_size))
        opened = [server_session.session_id for server_session in session._sessions]
        stalled.process.send_signal(signal.SIGSTOP)
        resume = threading.Timer(STALL, stalled.process.send_signal, args=(signal.SIGCONT,))
        resume.start()
        try:
            assert session.step(torch.randn(1, 1, hidden_size)).shape == (1, 1, hidden_size)
        finally:
            resume.cancel()
            stalled.process.send_signal(signal.SIGCONT)
        assert [server_session.session_id for server_session in session._sessions] == opened
    assert not model.remote_blocks.manager.bans


def test_a_step_waiting_for_a_stopped_server_ends_when_its_session_is_cancelled(shared_model):
    """``cancel`` from another thread (an API whose client left) ends a step that waits for a stopped
    server at once, and refuses the session's later steps."""
    model, servers = shared_model
    hidden_size = model.config.hidden_size
    stalled = servers[1]
    with model.inference_session(max_length=16) as session:
        session.step(torch.randn(1, 1, hidden_size))
        stalled.process.send_signal(signal.SIGSTOP)
        try:
            threading.Timer(1.0, session.cancel).start()
            started = time.monotonic()
            with pytest.raises(SessionCancelled):
                session.step(torch.randn(1, 1, hidden_size))
            assert time.monotonic() - started < 60  # not the 180 s the stopped server would be waited
            with pytest.raises(SessionCancelled):
                session.step(torch.randn(1, 1, hidden_size))
        finally:
            stalled.process.send_signal(signal.SIGCONT)
    assert not model.remote_blocks.manager.bans
    with model.inference_session(max_length=4) as session:  # the model goes on serving
        assert session.step(torch.randn(1, 2, hidden_size)).shape == (1, 2, hidden_size)


def test_a_refused_request_fails_fast_and_bans_nobody(shared_model):
    model, servers = shared_model
    started = time.monotonic()
    with pytest.raises(RequestRefused, match=r"\[bad_request\].*inference_max_length"):
        with model.inference_session(max_length=100) as session:
            session.step(torch.randn(1, 2, model.config.hidden_size))
    # retried, it would not end (max_retries=None); 5 s was too tight at load 4
    assert time.monotonic() - started < 10
    assert not model.remote_blocks.manager.bans
    assert all(server.process.poll() is None for server in servers)


def test_a_cancelled_call_bans_nobody(shared_model):
    model, _ = shared_model
    manager, network = model.remote_blocks.manager, model.remote_blocks.network
    hidden_size = model.config.hidden_size
    with model.inference_session(max_length=16) as session:
        session.step(torch.randn(1, 2, hidden_size))
        with pytest.raises(TimeoutError):  # the caller gives up (as on Ctrl-C): the step is cancelled
            network.run(session._step(torch.randn(1, 1, hidden_size), None, None), timeout=0.001)
    assert not manager.bans
    with model.inference_session(max_length=4) as session:
        assert session.step(torch.randn(1, 2, hidden_size)).shape == (1, 2, hidden_size)


@pytest.mark.parametrize("max_retries, expected", [(0, [0]), (1, [0, 0, 1])])
def test_backward_honours_max_retries(shared_model, tiny_model_path, max_retries, expected):
    """A server that hangs between forward and backward: backward gives up after ``max_retries``
    retries (each a timed-out attempt) instead of retrying forever."""
    shared, servers = shared_model
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        tiny_model_path("llama"),
        initial_peers=shared.config.initial_peers,
        max_retries=max_retries,
        request_timeout=2,
        ban_timeout=0,  # bans expire at once, so every retry goes back to the hung server
        min_backoff=0.01,
        **LOOPBACK_CLIENT,
    )
    manager = model.remote_blocks.manager
    attempts = []
    judge = manager.handle_failure

    async def recording(error, peer, attempt):
        attempts.append(attempt)
        await judge(error, peer, attempt)

    manager.handle_failure = recording
    embeddings = torch.randn(1, 3, model.config.hidden_size, requires_grad=True)
    outputs = model.remote_blocks(embeddings)
    hung = servers[1]  # blocks 2:4, the only server for them
    hung.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            outputs.sum().backward()
    finally:
        hung.process.send_signal(signal.SIGCONT)
        model.close()
    # max_retries=0: backward's first timeout raises at once, nothing is recomputed; max_retries=1:
    # backward fails once (attempt 0), recomputing the hung span forward uses attempts 0 and 1, then
    # raises: every step of the way counts against max_retries, never an endless loop
    assert attempts == expected
    assert not shared.remote_blocks.manager.bans
