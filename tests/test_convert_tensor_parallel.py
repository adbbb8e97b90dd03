"""A block sharded over ["cpu", "cpu"] computes what the whole block computes, forward and backward."""

import copy

import pytest
import torch
from transformers import FalconH1Config, Gemma3TextConfig, Gemma4TextConfig, Qwen3_5TextConfig

from conftest import TINY_CONFIGS
from petals.block import allocate_cache, cache_spec, make_block
from petals.convert import make_tensor_parallel
from petals.kv_cache import PagePool, ShardCaches, open_cache
from petals.loading import load_block
from petals.plugins import get_plugin_manager

DEVICES = ["cpu", "cpu"]


def shard_caches(config, batch_size, max_length, block_index=1):
    """One standalone cache per shard, each holding its share of the block's key/value heads."""
    spec = cache_spec(config, block_index).sharded(len(DEVICES))
    return ShardCaches(open_cache(spec, batch_size, max_length, layer_index=block_index) for _ in DEVICES)


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_sharded_block_equals_whole_block(tiny_model_path, variant):
    block = load_block(tiny_model_path(variant), 1)
    sharded = make_tensor_parallel(copy.deepcopy(block), block.config, DEVICES)

    cache, shards = allocate_cache(block.config, 2, 16, block_index=1), shard_caches(block.config, 2, 16)
    spec = cache_spec(block.config, 1)
    copies = len(DEVICES) if spec.num_kv_heads == 1 else 1  # one shared KV head is kept by every shard
    assert sum(c.nbytes for c in shards.parts) == copies * cache.nbytes
    torch.manual_seed(0)
    with torch.no_grad():
        for length in [5, 1, 1, 3]:  # prefill, then cached steps
            hidden = torch.randn(2, length, block.config.hidden_size)
            torch.testing.assert_close(
                sharded(hidden, shards.view()), block(hidden, cache.view()), atol=1e-5, rtol=0
            )

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
        sharded(torch.randn(1, 1, 64), [allocate_cache(block.config, 1, 4).view()])


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
    block = load_block(tiny_model_path(variant), 1)
    sharded = make_tensor_parallel(copy.deepcopy(block), block.config, DEVICES)
    spec = cache_spec(block.config, 1).sharded(len(DEVICES))
    pools = [PagePool(spec, num_pages=16, page_tokens=4) for _ in DEVICES]
    sessions = [
        ShardCaches(open_cache(spec, batch, 16, pool=pool, layer_index=1) for pool in pools)
        for batch in (1, 2)
    ]
    solo = [allocate_cache(block.config, batch, 16, block_index=1) for batch in (1, 2)]
    torch.manual_seed(0)
    with torch.no_grad():
        for session, cache, prompt in zip(sessions, solo, (6, 3), strict=True):  # different positions
            hidden = torch.randn(cache.num_sequences, prompt, block.config.hidden_size)
            torch.testing.assert_close(
                sharded(hidden, session.view()), block(hidden, cache.view()), atol=1e-5, rtol=0
            )
        for _ in range(3):
            steps = [torch.randn(cache.num_sequences, 1, block.config.hidden_size) for cache in solo]
            merged = sharded(torch.cat(steps), ShardCaches.merged(sessions))
            expected = torch.cat([block(step, cache.view()) for step, cache in zip(steps, solo, strict=True)])
            torch.testing.assert_close(merged, expected, atol=1e-5, rtol=0)
    for session in sessions:
        session.release()
    assert all(pool.free_pages == pool.num_pages for pool in pools)


# a block of gated delta net states (Qwen3.5's first layers), and one of a Mamba mixer beside attention
STATE_BLOCKS = {
    "linear attention": Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    ),
    "full attention and linear attention": FalconH1Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=4,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(STATE_BLOCKS))
def test_a_block_with_a_fixed_size_state_is_refused_in_one_line_naming_its_kind(kind):
    pytest.importorskip("tensor_parallel")
    tiny = STATE_BLOCKS[kind]
    config = get_plugin_manager().family(tiny.model_type).config_class.from_dict(tiny.to_dict())
    with torch.device("meta"):
        block = make_block(config, 0)
    with pytest.raises(NotImplementedError) as error:
        make_tensor_parallel(block, config, DEVICES)
    assert str(error.value) == (
        f"model type {tiny.model_type!r}: a {kind} cache cannot be split over devices yet; "
        "serve it without --tensor_parallel_devices"
    )


def test_a_block_reusing_keys_and_values_of_another_is_refused_in_one_line_naming_its_kind():
    """Its keys and values come from its source block, which tensor parallelism would shard apart."""
    pytest.importorskip("tensor_parallel")
    tiny = Gemma4TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=16, vocab_size=128, sliding_window=8, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 3, hidden_size_per_layer_input=0,
    )  # fmt: skip
    config = get_plugin_manager().family(tiny.model_type).config_class.from_dict(tiny.to_dict())
    with torch.device("meta"):
        block = make_block(config, 4)  # it reuses those of block 2
    with pytest.raises(NotImplementedError) as error:
        make_tensor_parallel(block, config, DEVICES)
    assert str(error.value) == (
        "model type 'gemma4_text': a shared sliding attention (8) cache cannot be split over devices yet; "
        "serve it without --tensor_parallel_devices"
    )


def test_a_kind_whose_family_has_no_sharding_plan_is_refused_in_one_line_naming_its_kind():
    """Gemma 3's sliding layers split their heads like any attention, but its plugin gives no plan."""
    pytest.importorskip("tensor_parallel")
    tiny = Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    config = get_plugin_manager().family(tiny.model_type).config_class.from_dict(tiny.to_dict())
    with torch.device("meta"):
        block = make_block(config, 0)
    with pytest.raises(NotImplementedError) as error:
        make_tensor_parallel(block, config, DEVICES)
    assert str(error.value) == (
        "model type 'gemma3_text' (sliding attention (8) cache): its plugin gives no tensor-parallel plan "
        "(hook tensor_parallel_config); serve it without --tensor_parallel_devices"
    )
