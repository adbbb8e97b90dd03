"""The serving engine without transport: requests in, tensors out, its queue driven by hand on a fake clock.

No p2p, no threads: a test submits requests, asks ``schedule(now)`` what runs next and ``step``s it,
so the order of work and the merging of sessions are checked exactly, and every result is compared
with the same blocks run directly.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextDecoderLayer,
    Qwen3NextRotaryEmbedding,
)

from petals import hookimpl
from petals.block import RotaryBlockMixin
from petals.config import DistributedConfigMixin
from petals.kv_cache import PAGE_TOKENS, TOKENS_PER_SEQUENCE, OutOfPagesError, SessionPreempted
from petals.plugins import PluginManager, using_plugin_manager
from petals.server.backend import BlockBackend, HostedBlocks
from petals.server.cache_budget import AllocationFailed, CacheBudget
from petals.server.engine import PREFILL_CHUNK_TOKENS, ServingEngine
from petals.server.metrics import ServerMetrics
from petals.server.scheduler import Batch, Priority, Scheduler
from petals.server.validation import Limits
from petals.wire_errors import NotServedError, WireError
from petals_llama.block import LlamaBlock
from petals_llama.config import DistributedLlamaConfig

CONFIG = DistributedLlamaConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=100,
)
LIMITS = Limits(
    max_batch_size=4096, inference_max_length=2048, request_timeout=30, session_timeout=60, step_timeout=30
)
UIDS = "tiny.0 tiny.1"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def blocks():
    torch.manual_seed(0)
    modules = [LlamaBlock(CONFIG, index).eval() for index in range(CONFIG.num_hidden_layers)]
    backends = [
        BlockBackend(f"tiny.{index}", index, module, CONFIG, torch.float32, torch.device("cpu"))
        for index, module in enumerate(modules)
    ]
    return HostedBlocks(backends)


@pytest.fixture
def engine(blocks):
    budget = CacheBudget(list(blocks.backends.values()), tokens_per_block=4096)
    return ServingEngine(
        blocks, budget, LIMITS, Scheduler(max_threads=1), dht_prefix="tiny", clock=FakeClock()
    )


def drain(engine: ServingEngine) -> list[Batch]:
    """Run everything queued, as the compute thread would; returns the batches in the order they ran."""
    batches = []
    while isinstance(batch := engine.schedule(engine.clock()), Batch):
        engine.step(batch)
        batches.append(batch)
    return batches


def open_session(
    engine: ServingEngine, hidden: torch.Tensor, max_length: int = 64, peer: str = "", **metadata
):
    return asyncio.run(engine.open_session(UIDS, {"max_length": max_length, **metadata}, [hidden], peer))


def run_directly(blocks: HostedBlocks, *steps: torch.Tensor) -> list[torch.Tensor]:
    """The same steps through the blocks with a cache of their own, one session alone."""
    caches = [backend.allocate_cache(steps[0].shape[0], 2048) for backend in blocks.backends.values()]
    outputs = []
    for hidden in steps:
        for backend, cache in zip(blocks.backends.values(), caches, strict=True):
            hidden = backend.inference_step(hidden, None, cache.view())
        outputs.append(hidden)
    return outputs


def test_decode_steps_of_sessions_merge_into_one_batch_and_equal_their_solo_runs(engine, blocks):
    generator = torch.Generator().manual_seed(1)
    prefills = [torch.randn(batch, length, 64, generator=generator) for batch, length in ((1, 5), (2, 3))]
    steps = [torch.randn(prefill.shape[0], 1, 64, generator=generator) for prefill in prefills]
    sessions = []
    for prefill in prefills:
        session, args = open_session(engine, prefill)
        first = engine.inference_step(session, args, {})
        drain(engine)
        sessions.append((session, first.result()))
    futures = [
        engine.inference_step(session, engine.step_args(session, {}, [step]), {})
        for (session, _), step in zip(sessions, steps, strict=True)
    ]
    batches = drain(engine)
    assert [len(batch.tasks) for batch in batches] == [2]  # one forward per block for both sessions
    assert engine.scheduler.batches_merged == 1
    for (_, first), future, prefill, step in zip(sessions, futures, prefills, steps, strict=True):
        expected = run_directly(blocks, prefill, step)
        torch.testing.assert_close(first, expected[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(future.result(), expected[1], atol=1e-5, rtol=0)


def test_a_long_prefill_runs_in_chunks_through_every_block_and_decode_steps_slip_in(engine, blocks):
    long_prefill = torch.randn(1, 2 * PREFILL_CHUNK_TOKENS + 10, 64)
    decoder, args = open_session(engine, torch.randn(1, 1, 64))
    engine.inference_step(decoder, args, {})
    drain(engine)
    prefiller, args = open_session(engine, long_prefill, max_length=2048)
    prefill = engine.inference_step(prefiller, args, {})
    first = engine.schedule(0.0)  # the prefill's rewind/reorder task
    engine.step(first)
    engine.step(engine.schedule(0.0))  # its first chunk, in the first block
    decode = engine.inference_step(decoder, engine.step_args(decoder, {}, [torch.randn(1, 1, 64)]), {})
    order = [batch.tasks[0].priority for batch in drain(engine)]
    assert order[0] == Priority.DECODE and decode.done()  # the decode step came before the prefill's rest
    assert order[1:] == [Priority.PREFILL] * (2 * 3 - 1)  # 2 blocks × 3 chunks, one of which ran already
    torch.testing.assert_close(prefill.result(), run_directly(blocks, long_prefill)[0], atol=1e-4, rtol=0)


def test_closing_a_session_gives_its_pages_back_after_its_queued_steps(engine):
    free = engine.budget.tokens_left
    session, args = open_session(engine, torch.randn(2, 8, 64))
    step = engine.inference_step(session, args, {})
    engine.close_session(session)
    assert engine.sessions.get(session.session_id) is None
    drain(engine)
    assert step.result().shape == (2, 8, 64)  # computed before the pages went back
    assert engine.budget.tokens_left == free


def test_a_kept_session_is_continued_by_its_own_client_and_computes_as_if_never_closed(engine, blocks):
    generator = torch.Generator().manual_seed(3)
    prefill, *steps = [torch.randn(1, length, 64, generator=generator) for length in (6, 1, 1, 2)]
    expected = run_directly(blocks, prefill, *steps)
    session, args = open_session(engine, prefill, peer="alice")
    for hidden in steps[:2]:
        engine.inference_step(session, args, {})
        drain(engine)
        args = engine.step_args(session, {}, [hidden])
    engine.inference_step(session, args, {})
    drain(engine)
    engine.close_session(session, keep="chat")  # 8 tokens kept, a page a block
    drain(engine)
    assert engine.info()["cache_pages"]["kept"] == 2 and engine.info()["stats"]["sessions_kept"] == 1
    free = engine.budget.tokens_left
    assert free == 2 * 2 * engine.budget.longest_session()  # kept pages count as free

    other, args = open_session(engine, steps[2], peer="mallory", resume={"key": "chat", "position": 8})
    assert other.resumed_at == 0 and args.hidden.shape[1] == 0  # not its session: it must send from 0
    engine.close_session(other)
    ahead, args = open_session(engine, steps[2], peer="alice", resume={"key": "chat", "position": 9})
    assert ahead.resumed_at == 8 and args.hidden.shape[1] == 0  # it holds 8: the client sends from there
    engine.close_session(ahead, keep="chat")  # an empty step: kept again, still at 8 tokens
    drain(engine)
    again, args = open_session(engine, steps[1], peer="alice", resume={"key": "chat", "position": 7})
    assert again.resumed_at == 7 and engine.info()["stats"]["sessions_resumed"] == 2
    redone = engine.inference_step(again, args, {})  # the last step again, after a rewind of one token
    drain(engine)
    last = engine.inference_step(again, engine.step_args(again, {}, [steps[2]]), {})
    drain(engine)
    torch.testing.assert_close(redone.result(), expected[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(last.result(), expected[3], atol=1e-5, rtol=0)
    engine.close_session(again)
    drain(engine)
    assert engine.info()["cache_pages"] == {
        "live": 0,
        "kept": 0,
        "free": engine.budget.arenas[torch.device("cpu")].num_pages,
    }


def test_an_abandoned_request_is_dropped_from_the_queue(engine):
    session, args = open_session(engine, torch.randn(1, 3, 64))
    abandoned = engine.inference_step(session, args, {})
    assert abandoned.cancel()
    assert drain(engine) == []
    assert engine.scheduler.next_batch(0.0) is None


@pytest.mark.parametrize(
    ("step", "metadata", "message"),
    [
        (torch.randn(2, 1, 64), {}, "this session has batch size 1"),
        (torch.randn(1, 1, 64), {"start_from_position": 9}, "start_from_position 9 is beyond the 3 tokens"),
        (torch.randn(1, 62, 64), {}, "Maximum length exceeded: 3 tokens so far \\+ 62 new > max_length 64"),
    ],
)
def test_a_bad_step_is_refused_before_anything_is_queued(engine, step, metadata, message):
    session, args = open_session(engine, torch.randn(1, 3, 64))
    engine.inference_step(session, args, {})
    drain(engine)
    with pytest.raises(WireError, match=message):
        engine.inference_step(session, engine.step_args(session, metadata, [step]), metadata)
    assert engine.scheduler.next_batch(0.0) is None and session.position == 3


def test_requests_for_other_blocks_or_adapters_are_refused(engine):
    with pytest.raises(NotServedError, match="does not serve tiny.7; it serves tiny.0 to tiny.1"):
        engine.forward("tiny.7", {}, [torch.randn(1, 1, 64)])
    with pytest.raises(WireError, match="unknown adapter 'lora'; this server has: none"):
        engine.forward(UIDS, {"active_adapter": "lora"}, [torch.randn(1, 1, 64)])


@pytest.mark.parametrize(
    ("graph_bytes", "backward_tasks"),
    [
        # each block forward once, keeping its graph, then a backward per block
        (1 << 30, ["forward+graph", "forward+graph", "backward", "backward"]),
        # past the budget: block 0 keeps its graph (its size unknown yet); block 1 is recomputed in its backward
        (1, ["forward+graph", "forward+backward", "backward"]),
        # --backward_graph_budget 0: no graph kept, every block recomputed in its backward (as in Petals)
        (0, ["", "forward+backward", "forward+backward"]),
    ],
)
def test_forward_and_backward_run_one_task_per_block(blocks, graph_bytes, backward_tasks):
    budget = CacheBudget(list(blocks.backends.values()), tokens_per_block=4096)
    engine = ServingEngine(
        blocks,
        budget,
        LIMITS,
        Scheduler(max_threads=1),
        dht_prefix="tiny",
        clock=FakeClock(),
        backward_graph_bytes=graph_bytes,
    )
    hidden = torch.randn(2, 4, 64, requires_grad=True)
    forward = engine.forward(UIDS, {}, [hidden.detach()])
    assert len(drain(engine)) == 2
    grad = torch.randn(2, 4, 64)
    backward = engine.backward(UIDS, {}, [hidden.detach(), grad])
    assert [batch.tasks[0].work for batch in drain(engine)] == backward_tasks
    expected = hidden
    for backend in blocks.backends.values():
        expected = backend.module(expected, None)
    torch.testing.assert_close(forward.result()[0], expected.detach(), atol=1e-5, rtol=0)
    (expected_grad,) = torch.autograd.grad(expected, hidden, grad)
    torch.testing.assert_close(backward.result()[0], expected_grad, atol=1e-5, rtol=0)
    assert engine.graphs.used == 0


def test_backward_requests_share_the_graph_budget_and_give_it_back(engine, blocks):
    one_block = blocks.backends["tiny.0"].forward_with_graph(torch.randn(2, 4, 64), None).saved_bytes
    engine.graphs.limit = 2 * one_block  # room for one request's two blocks
    first = engine.backward(UIDS, {}, [torch.randn(2, 4, 64), torch.randn(2, 4, 64)])
    second = engine.backward(UIDS, {}, [torch.randn(2, 4, 64), torch.randn(2, 4, 64)])
    assert len(drain(engine)) == 4 + 3  # one of them keeps one graph only, and recomputes its last block
    assert first.result()[0].shape == second.result()[0].shape == (2, 4, 64)
    assert engine.graphs.used == 0
    cancelled = engine.backward(UIDS, {}, [torch.randn(2, 4, 64), torch.randn(2, 4, 64)])
    engine.step(engine.schedule(engine.clock()))  # its first block's graph is held ...
    assert engine.graphs.used > 0
    cancelled.cancel()
    assert engine.schedule(engine.clock()) is None and engine.graphs.used == 0  # ... until it is dropped


def test_a_kept_graph_counts_activations_not_weights(blocks):
    backend = blocks.backends["tiny.0"]
    graph = backend.forward_with_graph(torch.randn(2, 4, 64), None)
    weights = sum(p.numel() * p.element_size() for p in backend.module.parameters())
    assert 2 * 4 * 64 * 4 <= graph.saved_bytes < weights  # at least the input; no weight counted
    bigger = backend.forward_with_graph(torch.randn(4, 4, 64), None)
    assert bigger.saved_bytes >= 2 * graph.saved_bytes * 0.9


def test_a_growing_session_preempts_the_newest_one_which_alone_fails_in_a_merged_batch(blocks):
    budget = CacheBudget(
        list(blocks.backends.values()), tokens_per_block=2 * PAGE_TOKENS
    )  # two pages a block
    engine = ServingEngine(
        blocks, budget, LIMITS, Scheduler(max_threads=1), dht_prefix="tiny", clock=FakeClock()
    )
    prefill = torch.randn(1, PAGE_TOKENS, 64)
    older, args = open_session(engine, prefill, max_length=2 * PAGE_TOKENS)
    engine.inference_step(older, args, {})  # its one page a block is full
    newer, args = open_session(engine, torch.randn(1, 1, 64), max_length=PAGE_TOKENS)  # the last pages
    engine.inference_step(newer, args, {})
    drain(engine)
    step = torch.randn(1, 1, 64)
    growing = engine.inference_step(older, engine.step_args(older, {}, [step]), {})
    preempted = engine.inference_step(newer, engine.step_args(newer, {}, [torch.randn(1, 1, 64)]), {})
    assert [len(batch.tasks) for batch in drain(engine)] == [2]  # both in one forward; the newer left it
    torch.testing.assert_close(growing.result(), run_directly(blocks, prefill, step)[1], atol=1e-5, rtol=0)
    with pytest.raises(SessionPreempted, match="went to an older session"):
        preempted.result()
    assert isinstance(SessionPreempted("x"), OutOfPagesError)  # a refusal of memory, sent as "preempted"
    assert engine.info()["stats"]["sessions_preempted"] == 1
    assert engine.info()["cache_pages"] == {"live": 4, "kept": 0, "free": 0}  # all the older one's now
    with pytest.raises(SessionPreempted):  # at once: its client replays it on a new session instead
        engine.inference_step(newer, engine.step_args(newer, {}, [torch.randn(1, 1, 64)]), {})


def test_two_servers_in_one_process_share_no_state(blocks):
    """Counters, metrics and the batch policy's learning belong to each server, not to the process."""
    prometheus = pytest.importorskip("prometheus_client")
    servers = []
    for _ in range(2):
        metrics = ServerMetrics(prometheus.CollectorRegistry())
        budget = CacheBudget(list(blocks.backends.values()), tokens_per_block=4096)
        engine = ServingEngine(
            blocks,
            budget,
            LIMITS,
            Scheduler(max_threads=2),
            dht_prefix="tiny",
            metrics=metrics,
            clock=FakeClock(),
        )
        metrics.serving = engine
        servers.append((engine, metrics))
    (busy, busy_metrics), (idle, idle_metrics) = servers
    session, args = open_session(busy, torch.randn(1, 3, 64))
    busy.inference_step(session, args, {})
    drain(busy)
    busy_metrics.request_started("rpc_inference")

    def scraped(metrics: ServerMetrics) -> str:
        return prometheus.generate_latest(metrics.registry).decode()

    assert busy.events["inference_steps"] == 1 and idle.events["inference_steps"] == 0
    assert busy.tokens_processed == 3 * 2 and idle.tokens_processed == 0  # 3 tokens through 2 blocks
    assert 'petals_server_requests_total{rpc="rpc_inference"} 1.0' in scraped(busy_metrics)
    assert "petals_server_tokens_computed_total 6.0" in scraped(busy_metrics)
    assert "petals_server_tokens_computed_total 0.0" in scraped(idle_metrics)
    assert 'rpc="rpc_inference"' not in scraped(idle_metrics)
    assert busy.scheduler.threads.mean_seconds and not idle.scheduler.threads.mean_seconds


class HybridBlock(RotaryBlockMixin, Qwen3NextDecoderLayer):
    rotary_class = Qwen3NextRotaryEmbedding


class DistributedHybridConfig(DistributedConfigMixin, Qwen3NextConfig):
    block_class = HybridBlock
    block_prefix = "model.layers"
    attn_class = Qwen3NextAttention


class HybridPlugin:
    @hookimpl
    def register_model_families(self, register):
        register(DistributedHybridConfig)


HYBRID = DistributedHybridConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
    vocab_size=100, intermediate_size=96, num_experts=0, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
)  # fmt: skip


@pytest.fixture
def hybrid():
    """Qwen3-Next's layers: three of linear attention (a state per sequence), then full attention (pages)."""
    manager = PluginManager()
    manager.register(HybridPlugin(), name="hybrid")
    torch.manual_seed(0)
    backends = [
        BlockBackend(
            f"hybrid.{index}", index, HybridBlock(HYBRID, index).eval(), HYBRID, torch.float32, "cpu"
        )
        for index in range(4)
    ]
    with using_plugin_manager(manager):
        blocks = HostedBlocks(backends)
        # bytes for three sequences of 64 tokens: a state page in each linear-attention block, and the
        # attention block's pages for 64 tokens, all pages of the one arena
        probe = CacheBudget(backends, tokens_per_block=TOKENS_PER_SEQUENCE)
        (page_nbytes,) = {arena.page_nbytes for arena in probe.arenas.values()}
        per_sequence = 3 + probe.pools["hybrid.3"][0].pages_for(64)
        budget = CacheBudget(backends, TOKENS_PER_SEQUENCE, nbytes=3 * per_sequence * page_nbytes)
        yield blocks, ServingEngine(blocks, budget, LIMITS, Scheduler(max_threads=1), dht_prefix="hybrid")


def test_a_hybrid_model_merges_rewinds_and_admits_sessions_by_their_states(hybrid):
    blocks, engine = hybrid
    uids = " ".join(blocks.backends)
    generator = torch.Generator().manual_seed(2)
    prefills = [torch.randn(batch, length, 64, generator=generator) for batch, length in ((1, 5), (2, 3))]
    steps = [torch.randn(prefill.shape[0], 1, 64, generator=generator) for prefill in prefills]
    free, sessions = engine.budget.tokens_left, []
    for prefill in prefills:
        session, args = asyncio.run(engine.open_session(uids, {"max_length": 64}, [prefill]))
        engine.inference_step(session, args, {})
        drain(engine)
        sessions.append(session)
    (arena,) = engine.budget.arenas.values()
    with pytest.raises(
        AllocationFailed,
        match=r"needs .* of cache \(4 × 64 tokens: 4 × \d+ pages of .*\) but the server's whole budget is",
    ):
        asyncio.run(engine.open_session(uids, {"max_length": 64}, [torch.randn(4, 1, 64)]))
    # each sequence holds a state page per linear-attention block and its keys' first page: too few are left
    assert arena.free_pages == arena.num_pages - 3 * 4 < 4
    with pytest.raises(AllocationFailed, match=r"first step needs .* \(4 pages\), .* are free"):
        asyncio.run(engine.open_session(uids, {"max_length": 64}, [torch.randn(1, 1, 64)]))

    def step_all(rewind: bool) -> list[torch.Tensor]:
        """One step of both sessions, merged although they sit at different positions."""
        futures = []
        for session, step in zip(sessions, steps, strict=True):
            metadata = {"start_from_position": session.position - 1} if rewind else {}
            futures.append(engine.inference_step(session, engine.step_args(session, {}, [step]), metadata))
        assert [len(batch.tasks) for batch in drain(engine)] == [2]  # one batch: a forward per block for both
        return [future.result() for future in futures]

    outputs = step_all(rewind=False)
    replayed = step_all(rewind=True)  # forgets the step and computes it again (speculative rollback)
    for prefill, step, output, again in zip(prefills, steps, outputs, replayed, strict=True):
        solo = run_directly(blocks, prefill, step)
        torch.testing.assert_close(output, solo[1], atol=1e-5, rtol=0)
        torch.testing.assert_close(again, solo[1], atol=1e-5, rtol=0)
    for session in sessions:
        engine.close_session(session)
    drain(engine)
    assert engine.budget.tokens_left == free  # the states went back
