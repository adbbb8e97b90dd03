"""The server's cache memory in bytes: one arena of equal-byte pages per device, shared by every kind."""

import asyncio

import pytest
import torch
from transformers import Gemma3TextConfig

from petals.kv_cache import (
    REWIND_MARGIN,
    FullAttentionSpec,
    LinearAttentionSpec,
    OutOfPagesError,
    PageArena,
    PagePool,
    SlidingWindowCache,
    StatePool,
    open_cache,
)
from petals.kv_cache.arena import page_nbytes_for, rows_per_page
from petals.plugins import get_plugin_manager
from petals.server.backend import BlockBackend
from petals.server.cache_budget import AllocationFailed, CacheBudget

WINDOW = 8


def test_an_arena_hands_out_the_run_asked_for_or_the_first_free_pages_and_refuses_taking_none():
    arena = PageArena(8, 64)
    assert arena.take(3, near=2) == [2, 3, 4]
    assert arena.take(2, near=3) == [5, 6]  # 3 is taken: the first free ones from there on
    assert arena.take(2, near=6) == [7, 0]  # past the end, around to the start
    with pytest.raises(OutOfPagesError, match="3 more pages needed, 1 pages of 64 bytes free"):
        arena.take(3)
    assert arena.free_pages == 1  # nothing was taken
    arena.give_back([3, 0])
    assert arena.take(3, near=1) == [1, 3, 0]
    with pytest.raises(RuntimeError, match="given back twice"):
        arena.give_back([5, 5])


def test_an_arenas_pages_hold_each_kinds_rows_exactly():
    # keys and values of 2 heads of 12 (96 bytes a token) beside 1 head of 16 (64 bytes): 16 tokens of the
    # larger, rounded up to a multiple of both rows, so each kind's rows fill a page
    page = page_nbytes_for([(16 * 96, 96), (16 * 64, 64)])
    assert page == 1536 and rows_per_page(page, 96) == 16 and rows_per_page(page, 64) == 24
    # a state is a page of its own: an attention row fits it a whole number of times
    assert page_nbytes_for([(16 * 256, 256), (10_000, 10_000)]) == 10_240
    # rows that share no small multiple: whole rows at a stride dividing the page, the rest spare
    page = page_nbytes_for([(16 * 1000, 1000), (16 * 1032, 1032)])
    assert page == 16_512 and rows_per_page(page, 1000) == 16 and rows_per_page(page, 1032) == 16


def test_pools_of_different_kinds_share_an_arena_and_never_overwrite_each_others_pages():
    full = FullAttentionSpec(num_kv_heads=2, key_dim=8, value_dim=4, num_query_heads=4)
    sliding = FullAttentionSpec(num_kv_heads=1, key_dim=8, value_dim=8, num_query_heads=4)
    state = LinearAttentionSpec(conv_dim=6, conv_kernel=3, recurrent_shape=(2, 4, 4))
    arena = PageArena(40, 1024)
    pools = [
        PagePool(full, arena=arena),
        PagePool(sliding, arena=arena, home=20),
        StatePool(state, arena=arena, home=30),
    ]
    assert [pool.page_tokens for pool in pools[:2]] == [8, 16]  # rows of 96 bytes at a stride of 128, of 64
    generator = torch.Generator().manual_seed(0)
    caches = [open_cache(pool.spec, 2, 64, pool=pool) for pool in pools]
    written = []
    for cache in caches[:2]:
        keys = torch.randn(2, cache.spec.num_kv_heads, 40, cache.spec.key_dim, generator=generator)
        values = torch.randn(2, cache.spec.num_kv_heads, 40, cache.spec.value_dim, generator=generator)
        cache.view().update(keys, values, 0)
        written.append((keys, values))
    layer = caches[2].view().layers[0]
    layer.update_conv_state(torch.randn(2, 6, 3, generator=generator))
    layer.update_recurrent_state(torch.randn(2, 2, 4, 4, generator=generator))
    for cache, (keys, values) in zip(caches[:2], written, strict=True):  # each still reads what it wrote
        read_keys, read_values = cache.view().layers[0]._read(40)
        assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    held = sum(cache.pages_held for cache in caches[:2]) + 2
    assert arena.free_pages == arena.num_pages - held
    for cache in caches:
        cache.release()
    assert arena.free_pages == arena.num_pages


def test_a_state_on_pages_another_kind_wrote_starts_from_zero():
    spec = FullAttentionSpec(num_kv_heads=1, key_dim=8, value_dim=8, num_query_heads=1)
    state = LinearAttentionSpec(conv_dim=4, conv_kernel=2, recurrent_shape=(1, 2, 2))
    arena = PageArena(4, 512)
    keys = PagePool(spec, arena=arena)
    cache = open_cache(spec, 1, 4 * keys.page_tokens, pool=keys)
    nan = torch.full((1, 1, 4 * keys.page_tokens, 8), float("nan"))
    cache.view().update(nan, nan, 0)  # every page full of NaN
    cache.release()
    states = open_cache(state, 2, 64, pool=StatePool(state, arena=arena))
    assert torch.equal(states.pool.conv[states._index], torch.zeros(2, 5, 4, 2))
    assert torch.equal(states.pool.recurrent[states._index], torch.zeros(2, 5, 1, 2, 2))


def test_a_lone_sessions_pages_lie_in_a_row_in_each_block_of_a_shared_arena():
    spec = FullAttentionSpec(num_kv_heads=1, key_dim=4, value_dim=4, num_query_heads=1)
    arena = PageArena(64, 16 * 32)
    pools = [PagePool(spec, arena=arena, home=home) for home in (0, 32)]
    caches = [open_cache(spec, 1, 400, pool=pool) for pool in pools]
    for length in (20, *([1] * 80)):  # a prefill, then decode steps: the blocks take pages in turn
        for cache in caches:
            cache.view().update(torch.ones(1, 1, length, 4), torch.ones(1, 1, length, 4), 0)
    assert [cache.contiguous_start() for cache in caches] == [0, 32 * 16]  # read as one slice each


def gemma3_like(blocks: int, full_every: int) -> list[BlockBackend]:
    """Gemma 3's layers: sliding windows, every ``full_every``-th one full attention."""
    layer_types = [
        "full_attention" if (index + 1) % full_every == 0 else "sliding_attention" for index in range(blocks)
    ]
    tiny = Gemma3TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=blocks, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, vocab_size=100, sliding_window=WINDOW, layer_types=layer_types,
    )  # fmt: skip
    config = get_plugin_manager().family("gemma3_text").config_class.from_dict(tiny.to_dict())
    return [
        BlockBackend(f"g.{index}", index, torch.nn.Identity(), config, torch.float32, torch.device("cpu"))
        for index in range(blocks)
    ]


def test_memory_the_sliding_blocks_do_not_hold_goes_to_the_full_attention_ones():
    backends = gemma3_like(6, full_every=6)  # five sliding blocks, one full
    tokens = 256
    budget = CacheBudget(backends, tokens_per_block=tokens, page_tokens=16)
    (arena,) = budget.arenas.values()
    assert budget.nbytes == 6 * tokens * backends[0].cache_spec.bytes_per_token(torch.float32)
    # a sliding block holds its window and the rewind margin, one page more: the rest is the full block's
    sliding_pages = -(-(WINDOW - 1 + REWIND_MARGIN) // 16) + 1
    longest = (arena.num_pages - 5 * sliding_pages) * 16
    assert budget.longest_session() == longest > 4 * tokens
    assert budget.tokens_left == 2 * 6 * longest
    with pytest.raises(AllocationFailed, match="whole budget is 96.0 KiB"):
        asyncio.run(budget.admit(backends, 1, longest + 1, 16, timeout=0))
    asyncio.run(budget.admit(backends, 1, longest, 16, timeout=0))
    caches = budget.open_caches(backends, 1, longest)
    generator = torch.Generator().manual_seed(0)
    full_keys = []
    for _ in range(longest // 16):  # the whole session in steps of 16 tokens, as the layers write them
        for cache in caches:
            keys = torch.randn(1, 1, 16, 8, generator=generator)
            cache.view().update(keys, keys, cache.layer_index)
            if not isinstance(cache, SlidingWindowCache):
                full_keys.append(keys)
    # the full block kept every token it wrote, the sliding ones their window, in the pages they share
    read = caches[5].view().layers[5]._read(longest)[0]
    assert torch.equal(read, torch.cat(full_keys, dim=2))
    assert caches[5].pages_held == longest // 16
    sliding_held = [cache.pages_held for cache in caches[:5]]
    assert all(sliding_pages - 1 <= held <= sliding_pages for held in sliding_held)  # at most the worst case
    assert arena.free_pages == 5 * sliding_pages - sum(sliding_held) < 6 and budget.longest_session() == 0
    assert budget.bytes_by_kind() == {
        "sliding_attention": sum(sliding_held) * arena.page_nbytes,
        "full_attention": longest // 16 * arena.page_nbytes,
    }
    with pytest.raises(AllocationFailed, match="first step needs 6.0 KiB \\(6 pages\\), .* are free"):
        asyncio.run(budget.admit(backends, 1, 16, 16, timeout=0))
    for cache in caches:
        cache.release()
    assert budget.bytes_left == budget.nbytes and budget.longest_session() == longest
