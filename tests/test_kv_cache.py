"""What each block caches (its cache spec, per kind) and the server cache's own rules."""

import asyncio
import time

import pytest
import torch
from transformers import DeepseekV3Config, DynamicCache, FalconH1Config, Lfm2Config, Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from conftest import tiny_config
from petals.auto import AutoDistributedConfig
from petals.block import allocate_cache, cache_spec
from petals.kv_cache import (
    MANAGERS,
    TOKENS_PER_SEQUENCE,
    AttentionCache,
    CacheOverflowError,
    FullAttentionSpec,
    HybridCache,
    HybridSpec,
    IndexedAttentionCache,
    IndexedAttentionSpec,
    IndexedPagePool,
    LinearAttentionSpec,
    LinearAttentionState,
    PagePool,
    SlidingWindowCache,
    SlidingWindowSpec,
    UnservedCacheKindError,
    UnservedSpec,
    describe_block,
    open_cache,
)
from petals.plugins import get_plugin_manager
from petals.server.backend import BlockBackend
from petals.server.cache_budget import AllocationFailed, CacheBudget
from petals_llama.config import DistributedLlamaConfig


@pytest.mark.parametrize(
    ("variant", "groups", "kv_heads"),
    [
        ("llama", 2, 2),
        ("mixtral", 2, 2),
        ("bloom", 1, 4),
        ("falcon-new", 2, 2),
        ("falcon-multi-query", 4, 1),
        ("falcon-rw", 1, 4),
    ],
)
def test_cache_spec_counts_grouped_and_multi_query_heads(variant, groups, kv_heads, tmp_path):
    tiny_config(variant).save_pretrained(tmp_path)
    config = AutoDistributedConfig.from_pretrained(tmp_path)
    assert config.num_key_value_groups == groups
    assert config.attn_class is not None  # every first-party config names its attention
    spec = cache_spec(config, 1)
    assert (spec.num_kv_heads, spec.key_dim, spec.value_dim, spec.num_query_heads) == (kv_heads, 16, 16, 4)
    assert spec.bytes_per_token(torch.bfloat16) == 2 * kv_heads * 16 * 2
    if getattr(config, "sliding_window", None):  # the tiny Mixtral slides
        assert isinstance(spec, SlidingWindowSpec) and spec.window == config.sliding_window
    else:
        assert type(spec) is FullAttentionSpec
        cache = allocate_cache(config, 3, 10, torch.bfloat16, block_index=1)
        assert cache.nbytes == 3 * 10 * spec.bytes_per_token(torch.bfloat16)


def test_keys_and_values_of_their_own_widths_are_cached_exactly():
    """DeepSeek's attention caches keys of 192 and values of 128 per head (here 12 and 8): to the byte."""
    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=None,
    )  # fmt: skip
    spec = describe_block(config, 0)
    assert spec == FullAttentionSpec(num_kv_heads=4, key_dim=12, value_dim=8, num_query_heads=4)
    cache = open_cache(spec, batch_size=2, max_length=5)
    assert cache.nbytes == 2 * 5 * 4 * (12 + 8) * 4
    keys, values = torch.randn(2, 4, 3, 12), torch.randn(2, 4, 3, 8)
    got_keys, got_values = cache.view().update(keys, values, 0)
    torch.testing.assert_close((got_keys, got_values), (keys, values))
    with pytest.raises(ValueError, match="keys of 8 and values of 8 per head; its cache spec says 12 and 8"):
        cache.view().update(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8), 0)


def test_each_layer_gets_its_own_kind_from_transformers():
    config = tiny_config("llama")
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config.sliding_window = 8
    kinds = [describe_block(config, index) for index in range(4)]
    assert [type(spec) for spec in kinds] == [SlidingWindowSpec, FullAttentionSpec] * 2
    assert kinds[0].window == 8 and kinds[0].tokens_held(10_000) == 8 - 1 + kinds[0].rewind_margin


def test_a_kind_without_a_manager_is_refused_in_one_line():
    config = Lfm2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=100,
        layer_types=["conv", "conv", "full_attention", "conv"],
    )  # fmt: skip
    assert describe_block(config, 0) == UnservedSpec("conv")
    assert isinstance(describe_block(config, 2), FullAttentionSpec)
    with pytest.raises(UnservedCacheKindError, match="^block 0 is a conv layer, which petals-core") as error:
        open_cache(describe_block(config, 0), 1, 8)
    assert "\n" not in str(error.value)


def test_a_served_kind_core_cannot_size_asks_the_plugin_for_its_spec():
    with pytest.raises(
        UnservedCacheKindError, match="^block 3 is an indexed attention layer, whose"
    ) as error:
        open_cache(UnservedSpec("indexed_attention"), 1, 8, layer_index=3)
    assert "cache_spec hook" in str(error.value) and "cannot cache yet" not in str(error.value)


# Qwen3-Next: three gated delta net (linear attention) layers, then full attention
HYBRID = Qwen3NextConfig(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=100,
    layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
)  # fmt: skip


def test_a_linear_attention_layer_keeps_the_state_it_allocates():
    spec = describe_block(HYBRID, 1)
    assert spec == LinearAttentionSpec(conv_dim=2 * 2 * 8 + 4 * 8, conv_kernel=4, recurrent_shape=(4, 8, 8))
    assert isinstance(describe_block(HYBRID, 3), FullAttentionSpec)  # a hybrid's attention block stays paged
    assert spec.bytes_per_token(torch.bfloat16) == 0 and spec.tokens_held(10_000) == 0
    state = 64 * 4 * 2 + 4 * 8 * 8 * 4  # the conv inputs in the server's dtype, the recurrence in float32
    assert spec.state_bytes(torch.bfloat16) == state
    assert spec.bytes_per_sequence(torch.bfloat16) == (1 + spec.snapshots) * state
    cache = open_cache(spec, 3, 100, torch.bfloat16, layer_index=1)
    assert cache.nbytes == 3 * spec.bytes_per_sequence(torch.bfloat16) == cache.pool.nbytes
    pool = LinearAttentionState.make_pool(spec, 4096, 16, torch.bfloat16, "cpu")  # a server's, as planned
    assert pool.num_pages == 4096 // TOKENS_PER_SEQUENCE
    assert pool.nbytes == spec.budget_bytes(4096, torch.bfloat16) == pool.num_pages * cache.pool.page_nbytes
    layer, reference = _delta_net(1), DynamicCache(config=HYBRID)  # transformers' own cache, for comparison
    hidden = torch.randn(3, 5, 32)
    layer(hidden, cache=reference)
    layer(hidden.to(torch.bfloat16).float(), cache=cache.view())
    assert reference.layers[1].conv_states[0].shape[1:] == (spec.conv_dim, spec.conv_kernel)
    assert reference.layers[1].recurrent_states[0].shape[1:] == spec.recurrent_shape
    assert reference.layers[1].recurrent_states[0].dtype == spec.recurrent_dtype


def _delta_net(layer_index: int = 0) -> Qwen3NextGatedDeltaNet:
    torch.manual_seed(layer_index)
    return Qwen3NextGatedDeltaNet(HYBRID, layer_index).eval()


def _run(layer, states: list[LinearAttentionState], hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(hidden, cache=type(states[0]).merged(states))


def test_linear_attention_states_of_sessions_at_different_positions_merge_into_one_forward():
    layer, spec = _delta_net(), describe_block(HYBRID, 0)
    pool = LinearAttentionState.make_pool(
        spec, tokens=8 * 256, page_tokens=16, dtype=torch.float32, device="cpu"
    )
    solo = [open_cache(spec, batch, 64) for batch in (1, 2, 1)]
    merged = [open_cache(spec, batch, 64, pool=pool) for batch in (1, 2, 1)]
    assert pool.free_pages == pool.num_pages - 4
    generator = torch.Generator().manual_seed(0)
    prefills = [torch.randn(1, 6, 32, generator=generator), torch.randn(2, 2, 32, generator=generator)]
    for index, prefill in enumerate(prefills):  # the third session starts at the merged steps
        _run(layer, [solo[index]], prefill)
        _run(layer, [merged[index]], prefill)
    for _ in range(3):
        steps = [torch.randn(batch, 1, 32, generator=generator) for batch in (1, 2, 1)]
        expected = [_run(layer, [state], step) for state, step in zip(solo, steps, strict=True)]
        got = _run(layer, merged, torch.cat(steps)).split([1, 2, 1])
        for one, other in zip(expected, got, strict=True):
            torch.testing.assert_close(other, one, rtol=0, atol=1e-6)
    assert [state.position for state in merged] == [9, 5, 3]
    for state in merged:
        state.release()
    assert pool.free_pages == pool.num_pages


def test_a_linear_attention_state_rewinds_to_a_recent_step_exactly():
    layer, spec = _delta_net(), describe_block(HYBRID, 0)
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randn(2, length, 32, generator=generator) for length in (5, 1, 3, 1, 1, 1, 1, 2)]
    state = open_cache(spec, 2, 64)
    outputs = [_run(layer, [state], step) for step in steps]
    assert state.position == 15
    with pytest.raises(
        ValueError, match="^cannot rewind to position 14: a linear-attention state goes back only to"
    ):
        state.rewind(14)  # inside the last, 2-token step: no state was ever computed there
    state.rewind(11)  # the start of the sixth step: its snapshot is kept (those of the last 4 steps are)
    assert state.position == 11
    torch.testing.assert_close(_run(layer, [state], steps[5]), outputs[5], rtol=0, atol=0)
    fresh = open_cache(spec, 2, 64)  # a fresh run to that point, as a failover server replays it: one prefill
    _run(layer, [fresh], torch.cat(steps[:5], dim=1))
    torch.testing.assert_close(_run(layer, [fresh], steps[5]), outputs[5], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"of one of its last 4 steps \(kept: 10, 11\)"):
        state.rewind(9)  # further back than the snapshots kept
    state.rewind(0)
    torch.testing.assert_close(_run(layer, [state], steps[0]), outputs[0], rtol=0, atol=0)


def test_a_linear_attention_state_reorders_beams_and_refuses_to_overflow():
    layer, spec = _delta_net(), describe_block(HYBRID, 0)
    hidden = torch.randn(2, 3, 32)
    state, swapped = open_cache(spec, 2, 4), open_cache(spec, 2, 4)
    _run(layer, [state], hidden)
    _run(layer, [swapped], hidden.flip(0))
    state.reorder(torch.tensor([1, 0]))
    step = torch.randn(2, 1, 32)
    torch.testing.assert_close(_run(layer, [state], step), _run(layer, [swapped], step), rtol=0, atol=1e-6)
    with pytest.raises(CacheOverflowError, match="4 cached \\+ 1 new tokens > max_length 4"):
        state.reserve(1)
    state.release()
    with pytest.raises(RuntimeError, match="released"):
        state.reserve(0)


def test_a_sliding_window_gives_back_the_pages_that_fell_out_of_it():
    spec = SlidingWindowSpec(
        num_kv_heads=1, key_dim=2, value_dim=2, num_query_heads=1, window=8, rewind_margin=4
    )
    pool = PagePool(spec, num_pages=64, page_tokens=4)
    cache = open_cache(spec, 1, 1000, pool=pool)
    assert isinstance(cache, SlidingWindowCache)
    peak = 0
    for step in range(200):
        keys = torch.full((1, 1, 1, 2), float(step))
        got_keys, _ = cache.view().update(keys, keys, 0)
        # what the step attends: its window (the last 7 cached tokens and itself), as transformers hands it
        visible = got_keys[0, 0, :, 0].tolist()
        assert visible[-min(step + 1, 8) :] == [float(p) for p in range(max(0, step - 7), step + 1)]
        peak = max(peak, cache.pages_held)
    # what admission counts for a session of 1000 tokens: the kept tokens span one page more than they fill
    assert peak == pool.max_pages(1000) == pool.pages_for(spec.tokens_kept) + 1
    assert pool.free_pages == pool.num_pages - cache.pages_held
    cache.rewind(199 - 4)  # the margin allows rolling back 4 tokens
    with pytest.raises(ValueError, match="cannot rewind to position 150: this sliding-window cache keeps"):
        cache.rewind(150)
    cache.rewind(0)  # a fresh start needs nothing that was dropped
    assert cache.pages_held == 0 and cache.position == 0
    cache.release()
    assert pool.free_pages == pool.num_pages


def test_cache_refuses_to_overflow_and_keeps_its_contents():
    cache = AttentionCache(FullAttentionSpec(1, 2, 2, 1), 1, max_length=3)
    cache.view().update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    with pytest.raises(
        CacheOverflowError, match="Maximum length exceeded: 2 cached \\+ 2 new tokens > max_length 3"
    ):
        cache.view().update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    assert cache.position == 2


def test_a_cache_answers_only_for_its_own_layer():
    cache = AttentionCache(FullAttentionSpec(1, 2, 2, 1), 1, max_length=3, layer_index=5)
    view = cache.view()
    assert len(view.layers) == 6 and view.layers[5] is view.layer
    with pytest.raises(ValueError, match="layer 4 wrote into the cache of block 5"):
        view.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 4)


def test_rewind_and_reorder_validate_their_arguments():
    cache = AttentionCache(FullAttentionSpec(1, 2, 2, 1), 2, max_length=4)
    cache.view().update(torch.arange(8.0).view(2, 1, 2, 2), torch.zeros(2, 1, 2, 2), 0)
    with pytest.raises(ValueError, match="cannot rewind to position 3: 2 tokens are cached"):
        cache.rewind(3)
    with pytest.raises(ValueError, match="hypo_ids must be in"):
        cache.reorder(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"hypo_ids must have shape \(2,\)"):
        cache.reorder(torch.tensor([0]))
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.view().layer.keys[0, :, :2], torch.arange(4.0, 8.0).view(1, 2, 2))
    cache.rewind(1)
    assert cache.position == 1


class WiderCacheLlamaConfig(DistributedLlamaConfig):
    """A family whose layers keep a key/value head per query head, whatever the HF config's KV heads say."""

    num_key_value_groups = 1
    attn_class = None  # the config alone decides (the attention's projections would say 2 heads)


def test_config_kv_attributes_decide_what_servers_allocate(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    config = AutoDistributedConfig.from_pretrained(tmp_path)
    assert cache_spec(config, 0).num_kv_heads == 2
    wider = WiderCacheLlamaConfig.from_pretrained(tmp_path, dht_prefix="wider")
    assert cache_spec(wider, 0) == FullAttentionSpec(
        num_kv_heads=4, key_dim=16, value_dim=16, num_query_heads=4
    )
    assert allocate_cache(wider, 1, 8).nbytes == 8 * 2 * 4 * 16 * 4


# a state-space mixer beside attention in one layer: 2 key/value heads of 8, a conv over 24 channels and
# a 4 x 2 state per head
MIXER_AND_ATTENTION = HybridSpec(
    attention=FullAttentionSpec(num_kv_heads=2, key_dim=8, value_dim=8, num_query_heads=4),
    state=LinearAttentionSpec(conv_dim=24, conv_kernel=4, recurrent_shape=(2, 4, 2)),
)


def test_a_hybrid_cache_rewinds_only_where_its_state_can_and_keeps_its_keys_then():
    cache = open_cache(MIXER_AND_ATTENTION, 1, 16)
    for new_tokens in (5, 1, 1):  # as a forward does: reserve, snapshot the state, write both
        cache.reserve(new_tokens)
        cache.state.snapshot()
        cache.state.stepped(new_tokens)
        cache.attention.length += new_tokens
    with pytest.raises(
        ValueError, match="^cannot rewind to position 3: a linear-attention state goes back only"
    ):
        cache.rewind(3)  # inside the prefill: no state was kept there
    assert cache.position == cache.state.position == 7  # and the keys and values are all still there
    cache.rewind(6)
    assert cache.position == cache.state.position == 6
    cache.release()
    assert cache.attention.pool.free_pages == cache.attention.pool.num_pages


@pytest.mark.parametrize(
    "attention",
    [
        MIXER_AND_ATTENTION.attention,
        SlidingWindowSpec(num_kv_heads=2, key_dim=8, value_dim=8, num_query_heads=4, window=8),
        IndexedAttentionSpec(num_kv_heads=1, key_dim=8, value_dim=4, num_query_heads=4, index_dim=3),
    ],
    ids=lambda spec: spec.kind,
)
def test_a_hybrid_keeps_its_attention_part_by_the_manager_of_that_kind(attention):
    spec = HybridSpec(attention=attention, state=MIXER_AND_ATTENTION.state)
    manager = MANAGERS[type(attention)]
    pool = HybridCache.make_pool(spec, tokens=64, page_tokens=4, dtype=torch.float32, device="cpu")
    assert type(pool.attention) is manager.pool_class  # an indexed kind's pages keep its indexer keys
    assert type(open_cache(spec, 1, 16).attention) is manager
    assert type(open_cache(spec, 1, 16, pool=pool).attention) is manager


def test_the_budget_admits_a_hybrid_block_by_the_bytes_of_both_its_pages_and_its_states():
    tiny = FalconH1Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=4,
    )  # fmt: skip
    config = get_plugin_manager().family("falcon_h1").config_class.from_dict(tiny.to_dict())
    backends = [
        BlockBackend(f"h1.{index}", index, torch.nn.Identity(), config, torch.float32, torch.device("cpu"))
        for index in range(2)
    ]
    assert all(isinstance(backend.cache_spec, HybridSpec) for backend in backends)
    budget = CacheBudget(backends, tokens_per_block=2 * TOKENS_PER_SEQUENCE)
    spec = backends[0].cache_spec
    (arena,) = budget.arenas.values()
    planned = 2 * spec.budget_bytes(2 * TOKENS_PER_SEQUENCE, torch.float32)  # as the planner counts it
    assert planned - arena.page_nbytes < budget.nbytes <= planned
    # one arena: both parts of both blocks take its pages, a state one page, keys as many tokens as fit
    attention, state = budget.parts["h1.0"]
    assert attention.arena is state.arena is arena and budget.parts["h1.1"][0].arena is arena
    assert arena.page_nbytes >= state.slot_nbytes(spec.state, torch.float32)
    assert attention.page_tokens == arena.page_nbytes // attention.row_nbytes(spec.attention, torch.float32)
    per_sequence = 2 * (1 + attention.pages_for(64))  # of max_length 64, in both blocks
    fit = arena.num_pages // per_sequence
    assert budget.tokens_left == 2 * 2 * budget.longest_session() > 2 * 2 * 64
    with pytest.raises(
        AllocationFailed, match=f"{fit + 1} × {per_sequence // 2 * 2} pages of .* whole budget is"
    ):
        asyncio.run(budget.admit(backends, fit + 1, 64, 8, timeout=0))
    asyncio.run(budget.admit(backends, fit, 64, 8, timeout=0))
    caches = budget.open_caches(backends, fit, 64)
    for cache in caches:
        cache.reserve(64)  # every sequence at its max_length: the arena holds no other sequence of 64
    assert arena.free_pages == arena.num_pages - fit * per_sequence < per_sequence
    assert budget.longest_session() < 64
    assert budget.bytes_by_kind() == {
        "full_attention": fit * 2 * attention.pages_for(64) * arena.page_nbytes,
        "linear_attention": fit * 2 * arena.page_nbytes,
    }
    with pytest.raises(AllocationFailed, match="first step needs"):
        asyncio.run(budget.admit(backends, 1, 64, 64, timeout=0))
    for cache in caches:
        cache.release()
    assert arena.free_pages == arena.num_pages and budget.bytes_used == 0
    assert budget.tokens_left == 2 * 2 * budget.longest_session() > 2 * 2 * 64


def test_a_waiting_admission_is_woken_when_another_session_gives_its_pages_back():
    config = DistributedLlamaConfig.from_dict(tiny_config("llama").to_dict())
    backends = [
        BlockBackend(f"llama.{index}", index, torch.nn.Identity(), config, torch.float32, torch.device("cpu"))
        for index in range(2)
    ]
    budget = CacheBudget(backends, tokens_per_block=32, page_tokens=16)  # four pages in all
    assert [arena.num_pages for arena in budget.arenas.values()] == [4]
    taken = budget.open_caches(backends, 1, 32)
    for cache in taken:
        cache.reserve(32)
    assert budget.tokens_left == 0

    async def wait_then_free() -> float:
        waiting = asyncio.create_task(budget.admit(backends, 1, 32, 16, timeout=60))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # it waits for a page...
        freed = time.monotonic()
        await asyncio.to_thread(lambda: [cache.release() for cache in taken])  # as the compute thread does
        await asyncio.wait_for(waiting, 10)  # ...and is woken by its release, long before its 60 s
        return time.monotonic() - freed

    assert asyncio.run(wait_then_free()) < 5
    assert budget.tokens_left == 2 * 2 * 32  # the longest session: two pages in each block


# a latent of 6 and a rope key of 2 as one key/value "head" read by 4 query heads, and indexer keys of 3
INDEXED = IndexedAttentionSpec(num_kv_heads=1, key_dim=6, value_dim=2, num_query_heads=4, index_dim=3)


def _indexed_step(cache, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As an indexed layer writes a step: keys and values, then the same tokens' indexer keys (each
    tensor filled with its token's value, so what is read back shows where it came from)."""
    rows, length = tokens.shape
    view = cache.view() if not isinstance(cache, list) else IndexedAttentionCache.merged(cache)
    keys, _ = view.update(
        tokens.view(rows, 1, length, 1).expand(-1, -1, -1, 6), torch.zeros(rows, 1, length, 2), 0
    )
    return keys[:, 0, :, 0], view.update_indexer(tokens[..., None].expand(-1, -1, 3), 0)[..., 0]


def test_an_indexed_attention_cache_keeps_its_indexer_keys_in_the_pages_of_its_keys():
    assert INDEXED.bytes_per_token(torch.bfloat16) == (6 + 2 + 3) * 2
    pool = IndexedAttentionCache.make_pool(
        INDEXED, tokens=64, page_tokens=4, dtype=torch.float32, device="cpu"
    )
    assert isinstance(pool, IndexedPagePool) and pool.nbytes == 16 * pool.page_nbytes == 64 * 11 * 4
    cache = open_cache(INDEXED, 2, 12, pool=pool)
    keys, indexer_keys = _indexed_step(cache, torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    assert torch.equal(indexer_keys, keys) and indexer_keys.shape == (2, 3)
    assert cache.nbytes == 2 * pool.page_nbytes  # one page per sequence: keys, values and indexer keys
    cache.reorder(torch.tensor([1, 1]))  # every per-token tensor moves with the beams
    keys, indexer_keys = _indexed_step(cache, torch.tensor([[7.0], [8.0]]))
    assert indexer_keys.tolist() == keys.tolist() == [[4, 5, 6, 7], [4, 5, 6, 8]]
    cache.rewind(2)  # and rewinds with them: the next step's indexer keys follow the kept ones
    keys, indexer_keys = _indexed_step(cache, torch.full((2, 2), 9.0))
    assert indexer_keys.tolist() == keys.tolist() == [[4, 5, 9, 9]] * 2
    cache.release()
    assert pool.free_pages == pool.num_pages


def test_indexed_attention_caches_of_sessions_at_different_positions_merge_left_padded():
    pool = IndexedAttentionCache.make_pool(
        INDEXED, tokens=64, page_tokens=3, dtype=torch.float32, device="cpu"
    )
    long, short = open_cache(INDEXED, 1, 16, pool=pool), open_cache(INDEXED, 2, 16, pool=pool)
    _indexed_step(long, torch.tensor([[1.0, 2, 3, 4, 5]]))
    _indexed_step(short, torch.tensor([[1.0], [2]]))
    keys, indexer_keys = _indexed_step([long, short], torch.tensor([[6.0], [7], [8]]))
    assert (
        indexer_keys.tolist() == keys.tolist() == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 7], [0, 0, 0, 0, 2, 8]]
    )


def test_indexer_keys_are_refused_unless_they_follow_their_keys_at_their_width():
    cache = open_cache(INDEXED, 1, 8)
    assert isinstance(cache, IndexedAttentionCache)
    with pytest.raises(ValueError, match="update_indexer got 2 tokens after an update of None"):
        cache.view().update_indexer(torch.zeros(1, 2, 3), 0)
    view = cache.view()
    view.update(torch.zeros(1, 1, 2, 6), torch.zeros(1, 1, 2, 2), 0)
    with pytest.raises(ValueError, match="indexer keys of 5 values; its cache spec says 3: fix the family's"):
        view.update_indexer(torch.zeros(1, 2, 5), 0)
    with pytest.raises(ValueError, match="layer 1 wrote indexer keys into the cache of block 0"):
        view.update_indexer(torch.zeros(1, 2, 3), 1)
