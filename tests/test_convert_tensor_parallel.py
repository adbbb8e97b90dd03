"""A block sharded over ["cpu", "cpu"] computes what the whole block computes, forward and backward."""

import copy

import pytest
import torch

from conftest import TINY_CONFIGS
from petals.block import allocate_cache, kv_cache_layout
from petals.convert import make_tensor_parallel
from petals.loading import load_block

DEVICES = ["cpu", "cpu"]


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_sharded_block_equals_whole_block(tiny_model_path, variant):
    block = load_block(tiny_model_path(variant), 1)
    sharded = make_tensor_parallel(copy.deepcopy(block), block.config, DEVICES)

    cache, shard_caches = allocate_cache(block.config, 2, 16), sharded.allocate_caches(2, 16)
    layout = kv_cache_layout(block.config)
    copies = len(DEVICES) if layout.num_kv_heads == 1 else 1  # one shared KV head is kept by every shard
    assert sum(c.nbytes for c in shard_caches) == copies * cache.nbytes
    torch.manual_seed(0)
    with torch.no_grad():
        for length in [5, 1, 1, 3]:  # prefill, then cached steps
            hidden = torch.randn(2, length, block.config.hidden_size)
            torch.testing.assert_close(sharded(hidden, shard_caches), block(hidden, cache), atol=1e-5, rtol=0)

    hidden = torch.randn(2, 5, block.config.hidden_size, requires_grad=True)
    weights = torch.randn(2, 5, block.config.hidden_size)
    (expected,) = torch.autograd.grad((block(hidden) * weights).sum(), hidden)
    (got,) = torch.autograd.grad((sharded(hidden) * weights).sum(), hidden)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_heads_that_do_not_split_are_refused(tiny_model_path):
    block = load_block(tiny_model_path("llama"), 0)  # 4 query heads, 2 key/value heads
    with pytest.raises(ValueError, match="2 key/value heads do not split over 4 devices"):
        make_tensor_parallel(block, block.config, ["cpu"] * 4)


def test_wrong_number_of_caches_is_refused(tiny_model_path):
    block = load_block(tiny_model_path("llama"), 0)
    sharded = make_tensor_parallel(block, block.config, DEVICES)
    with pytest.raises(ValueError, match=r"expected one cache per shard \(2\), got 1"):
        sharded(torch.randn(1, 1, 64), [allocate_cache(block.config, 1, 4)])


def test_sharding_plans_come_from_the_family_plugins(tmp_path):
    import tensor_parallel as tp

    from petals.auto import AutoDistributedConfig
    from petals.plugins import get_plugin_manager

    manager = get_plugin_manager()
    for variant in TINY_CONFIGS:
        TINY_CONFIGS[variant].save_pretrained(tmp_path / variant)
        config = AutoDistributedConfig.from_pretrained(tmp_path / variant)
        assert isinstance(
            manager.family_hooks(config).tensor_parallel_config(config=config, world_size=2), tp.Config
        ), variant


@pytest.mark.parametrize("variant", ["llama", "bloom"])
def test_sharded_sessions_at_different_positions_share_one_forward(tiny_model_path, variant):
    from petals.convert import ShardedCache
    from petals.kv_cache import BlockCache

    block = load_block(tiny_model_path(variant), 1)
    sharded = make_tensor_parallel(copy.deepcopy(block), block.config, DEVICES)
    pools = sharded.make_pools(num_pages=16, page_tokens=4, dtype=torch.float32)
    sessions = [ShardedCache(BlockCache.paged(pool, batch, 16) for pool in pools) for batch in (1, 2)]
    solo = [allocate_cache(block.config, batch, 16) for batch in (1, 2)]
    torch.manual_seed(0)
    with torch.no_grad():
        for session, cache, prompt in zip(sessions, solo, (6, 3), strict=True):  # different positions
            hidden = torch.randn(cache.num_sequences, prompt, block.config.hidden_size)
            torch.testing.assert_close(sharded(hidden, session), block(hidden, cache), atol=1e-5, rtol=0)
        for _ in range(3):
            steps = [torch.randn(cache.num_sequences, 1, block.config.hidden_size) for cache in solo]
            merged = sharded(torch.cat(steps), ShardedCache.merged(sessions))
            expected = torch.cat([block(step, cache) for step, cache in zip(steps, solo, strict=True)])
            torch.testing.assert_close(merged, expected, atol=1e-5, rtol=0)
    for session in sessions:
        session.release()
    assert all(pool.free_pages == pool.num_pages for pool in pools)
