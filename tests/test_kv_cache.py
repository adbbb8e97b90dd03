"""KV sizing per family and the server cache's own rules."""

import pytest
import torch

from conftest import tiny_config
from petals.auto import AutoDistributedConfig
from petals.block import allocate_cache, kv_cache_layout
from petals.kv_cache import BlockCache, CacheOverflowError, KVCacheLayout
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
def test_kv_layout_counts_grouped_and_multi_query_heads(variant, groups, kv_heads, tmp_path):
    tiny_config(variant).save_pretrained(tmp_path)
    config = AutoDistributedConfig.from_pretrained(tmp_path)
    assert config.num_key_value_groups == groups
    layout = kv_cache_layout(config)
    assert (layout.num_kv_heads, layout.head_dim) == (kv_heads, 16)
    assert layout.bytes_per_token(torch.bfloat16) == 2 * kv_heads * 16 * 2
    assert allocate_cache(config, 3, 10, torch.bfloat16).nbytes == 3 * 10 * layout.bytes_per_token(
        torch.bfloat16
    )


def test_cache_refuses_to_overflow_and_keeps_its_contents():
    cache = BlockCache(KVCacheLayout(num_kv_heads=1, head_dim=2, num_query_heads=1), 1, max_length=3)
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    with pytest.raises(
        CacheOverflowError, match="Maximum length exceeded: 2 cached \\+ 2 new tokens > max_length 3"
    ):
        cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    assert cache.position == 2


def test_rewind_and_reorder_validate_their_arguments():
    cache = BlockCache(KVCacheLayout(num_kv_heads=1, head_dim=2, num_query_heads=1), 2, max_length=4)
    cache.update(torch.arange(8.0).view(2, 1, 2, 2), torch.zeros(2, 1, 2, 2), 0)
    with pytest.raises(ValueError, match="cannot rewind to position 3: 2 tokens are cached"):
        cache.rewind(3)
    with pytest.raises(ValueError, match="hypo_ids must be in"):
        cache.reorder(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"hypo_ids must have shape \(2,\)"):
        cache.reorder(torch.tensor([0]))
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.layer.keys[0, :, :2], torch.arange(4.0, 8.0).view(1, 2, 2))
    cache.rewind(1)
    assert cache.position == 1


class WiderCacheLlamaConfig(DistributedLlamaConfig):
    """A family whose layers keep a key/value head per query head, whatever the HF config's KV heads say."""

    num_key_value_groups = 1


def test_config_kv_attributes_decide_what_servers_allocate(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    config = AutoDistributedConfig.from_pretrained(tmp_path)
    assert kv_cache_layout(config).num_kv_heads == 2
    wider = WiderCacheLlamaConfig.from_pretrained(tmp_path, dht_prefix="wider")
    assert kv_cache_layout(wider) == KVCacheLayout(num_kv_heads=4, head_dim=16, num_query_heads=4)
    assert allocate_cache(wider, 1, 8).nbytes == 8 * 2 * 4 * 16 * 4
