"""Core's own answers to the hooks, registered like any plugin and tried last."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from petals.hookspecs import hookimpl
from petals.kv_cache import KVCacheLayout


@hookimpl(trylast=True)
def block_class(config: PretrainedConfig) -> type[torch.nn.Module]:
    return config.block_class


@hookimpl(trylast=True)
def kv_cache_layout(config: PretrainedConfig) -> KVCacheLayout:
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return KVCacheLayout(
        num_kv_heads=num_heads // config.num_key_value_groups, head_dim=head_dim, num_query_heads=num_heads
    )


@hookimpl(trylast=True)
def dht_prefix(model_id: str) -> str:
    return model_id.rsplit("/", 1)[-1].replace(".", "-")


@hookimpl(trylast=True)
def convert_block_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return state_dict
