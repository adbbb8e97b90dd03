"""Core's own answers to the hooks, registered like any plugin and tried last."""

from __future__ import annotations

from petals.hookspecs import hookimpl


@hookimpl(trylast=True)
def dht_prefix(model_id: str) -> str:
    return model_id.rsplit("/", 1)[-1].replace(".", "-")


@hookimpl(trylast=True)
def cache_spec(config, block_index: int):
    from petals.kv_cache import describe_block

    return describe_block(config, block_index)
