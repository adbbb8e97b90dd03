"""Core's own answers to the hooks, registered like any plugin and tried last."""

from __future__ import annotations

from petals.hookspecs import hookimpl


@hookimpl(trylast=True)
def dht_prefix(model_id: str) -> str:
    return model_id.rsplit("/", 1)[-1].replace(".", "-")
