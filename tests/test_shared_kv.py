"""Layers that reuse an earlier layer's keys and values, in the serving engine without transport.

A Gemma 4 of 6 layers, sliding and full in turn, whose layers 4 and 5 attend with the keys and values
layers 2 and 3 compute in the same pass (``num_kv_shared_layers=2``), all hosted by one engine: a prefill
long enough to run in chunks, each through every block, equals the same step run as one pass; the
reusing blocks hold no memory and count, in ``cache_tokens_left``, as their sources; a request whose
span splits the sharing blocks is refused in one line; a backward through them gives transformers'
gradient (block by block, a reusing block would miss its source's keys and values).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4TextConfig, Gemma4TextModel

from conftest import save_random_model
from petals.auto import AutoDistributedConfig
from petals.client.verification import LocalBlocks
from petals.kv_cache import SharedKVSpec, check_span, closed_boundaries
from petals.plugins import get_plugin_manager
from petals.server.backend import BlockBackend, HostedBlocks
from petals.server.cache_budget import CacheBudget
from petals.server.engine import PREFILL_CHUNK_TOKENS, ServingEngine
from petals.server.scheduler import Batch, Scheduler
from petals.server.validation import Limits
from petals.wire_errors import WireError

TEXT = Gemma4TextConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=16,
    vocab_size=100,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 3,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=0,
)
LIMITS = Limits(
    max_batch_size=4096, inference_max_length=2048, request_timeout=30, session_timeout=60, step_timeout=30
)
ALL = " ".join(f"gemma.{index}" for index in range(6))


@pytest.fixture(scope="module")
def blocks() -> HostedBlocks:
    config = get_plugin_manager().family("gemma4_text").config_class.from_dict(TEXT.to_dict())
    torch.manual_seed(0)
    return HostedBlocks(
        [
            BlockBackend(f"gemma.{index}", index, config.block_class(config, index).eval(), config, *CPU32)
            for index in range(6)
        ]
    )


CPU32 = (torch.float32, torch.device("cpu"))


@pytest.fixture
def engine(blocks: HostedBlocks) -> ServingEngine:
    budget = CacheBudget(list(blocks.backends.values()), tokens_per_block=4096)
    return ServingEngine(blocks, budget, LIMITS, Scheduler(max_threads=1), dht_prefix="gemma")


def drain(engine: ServingEngine) -> int:
    tasks = 0
    while isinstance(batch := engine.schedule(0.0), Batch):
        engine.step(batch)
        tasks += 1
    return tasks


def test_the_last_layers_reuse_their_sources_and_no_span_splits_them(blocks):
    specs = [backend.cache_spec for backend in blocks.backends.values()]
    assert [spec.reads_from for spec in specs] == [None, None, None, None, 2, 3]
    assert isinstance(specs[4], SharedKVSpec) and specs[4].attention == specs[2]
    assert closed_boundaries(specs) == {3, 4, 5}
    check_span(closed_boundaries(specs), 2, 6)
    with pytest.raises(ValueError) as refused:
        check_span(closed_boundaries(specs), 4, 6)
    assert str(refused.value) == (
        "blocks 4:6 split blocks 2:6, which share keys and values (later layers attend with those of earlier "
        "ones, in the same pass): a span may begin or end at 2 or 6, not in between"
    )


def test_a_long_prefill_in_chunks_equals_one_pass_and_reusing_blocks_hold_nothing(engine, blocks):
    prefill = torch.randn(1, 2 * PREFILL_CHUNK_TOKENS + 10, 64, generator=torch.Generator().manual_seed(1))
    step = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(2))
    free_before = engine.budget.tokens_left
    session, args = asyncio.run(engine.open_session(ALL, {"max_length": 2048}, [prefill]))
    chunked = engine.inference_step(session, args, {})
    assert drain(engine) == 1 + 3 * 6  # a rewind/reorder task, then 3 chunks through 6 blocks
    decoded = engine.inference_step(session, engine.step_args(session, {}, [step]), {})
    drain(engine)
    assert [cache.nbytes for cache in session.caches[4:]] == [0, 0]
    assert all(cache.nbytes > 0 for cache in session.caches[:4])
    # reusing blocks hold no pages, and count in tokens_left as their sources do (keys and values apart,
    # as Petals counts): the longest session the free pages hold, in each of the six blocks
    parts = engine.budget.parts
    assert parts["gemma.4"] == parts["gemma.5"] == []
    assert len(engine.budget.counted) == 6
    assert engine.budget.tokens_left == 2 * 6 * engine.budget.longest_session() < free_before

    caches = [backend.allocate_cache(1, 2048) for backend in blocks.backends.values()]
    expected = []
    for hidden in (prefill, step):
        shared = {}  # one pass
        for backend, cache in zip(blocks.backends.values(), caches, strict=True):
            hidden = backend.inference_step(hidden, None, cache.view(), shared)
        expected.append(hidden)
    torch.testing.assert_close(chunked.result(), expected[0], atol=1e-4, rtol=0)  # as in test_server_engine
    torch.testing.assert_close(decoded.result(), expected[1], atol=1e-5, rtol=0)


def test_a_span_that_splits_sharing_blocks_is_refused_in_one_line(engine):
    hidden = torch.randn(1, 4, 64)
    with pytest.raises(WireError) as refused:
        engine.forward("gemma.4 gemma.5", {}, [hidden])
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("blocks 4:6 split blocks 2:6, which share keys and values")
    assert engine.budget.tokens_left == CacheBudget(list(engine.blocks.backends.values()), 4096).tokens_left
    forward = engine.forward("gemma.2 gemma.3 gemma.4 gemma.5", {}, [hidden])
    drain(engine)
    expected, shared = hidden, {}  # the same span as one pass, without a cache
    for index in range(2, 6):
        expected = engine.blocks.backends[f"gemma.{index}"].forward(expected, None, shared)
    torch.testing.assert_close(forward.result()[0], expected, atol=1e-6, rtol=0)


def test_a_backward_through_reusing_blocks_gives_transformers_gradient(blocks):
    """The reused keys and values carry gradient back into their source blocks: the span runs as one graph."""
    torch.manual_seed(3)
    reference = Gemma4TextModel(Gemma4TextConfig(**{**TEXT.to_dict(), "output_hidden_states": True})).eval()
    config = blocks.config
    backends = [
        BlockBackend(f"gemma.{index}", index, config.block_class(config, index).eval(), config, *CPU32)
        for index in range(6)
    ]
    for backend, layer in zip(backends, reference.layers, strict=True):
        backend.module.load_state_dict(layer.state_dict())
    engine = ServingEngine(
        HostedBlocks(backends),
        CacheBudget(backends, tokens_per_block=4096),
        LIMITS,
        Scheduler(max_threads=1),
        dht_prefix="gemma",
    )
    embeddings = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(4))
    grad_output = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(5))

    leaf = embeddings.clone().requires_grad_(True)
    outputs = []
    hook = reference.layers[-1].register_forward_hook(lambda module, args, output: outputs.append(output))
    reference(inputs_embeds=leaf)
    hook.remove()
    (expected,) = torch.autograd.grad((outputs[0] * grad_output).sum(), leaf)

    backward = engine.backward(ALL, {}, [embeddings, grad_output])
    drain(engine)
    torch.testing.assert_close(backward.result()[0], expected, atol=1e-5, rtol=0)


def test_a_verifying_clients_own_copy_runs_reusing_blocks_in_one_pass(tmp_path):
    """The judge a client falls back to when no other server serves a span (``verify``) hands its blocks
    one dict per pass too, and gives transformers' outputs."""
    config = Gemma4TextConfig(**{**TEXT.to_dict(), "output_hidden_states": True})
    path = save_random_model(config, tmp_path / "gemma4")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    embeddings = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(6))
    outputs = []
    hook = reference.model.layers[-1].register_forward_hook(
        lambda module, args, output: outputs.append(output)
    )
    with torch.no_grad():
        reference(inputs_embeds=embeddings)
    hook.remove()
    distributed = AutoDistributedConfig.from_pretrained(path)
    distributed.name_or_path = str(path)  # as the client model sets it
    torch.testing.assert_close(
        LocalBlocks(distributed).run(0, 6, embeddings, None), outputs[0], atol=1e-5, rtol=0
    )
