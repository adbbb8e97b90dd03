"""petals-core: run large language models collaboratively, with model families as plugins."""

from __future__ import annotations

import importlib
from typing import Any

from petals.hookspecs import hookimpl
from petals.patches import install_import_patches

install_import_patches()  # before anything imports hivemind or transformers' masks (petals.patches says why)

__version__ = "0.1.0"

# Public names, imported on first access so that `import petals` stays cheap.
_LAZY = {
    "AutoDistributedConfig": "petals.auto",
    "ClientConfig": "petals.config",
    "PTuneConfig": "petals.config",
    "LMHeadConfig": "petals.config",
    "DistributedConfigMixin": "petals.config",
    "LazyClass": "petals.config",
    "CacheSpec": "petals.kv_cache",
    "FullAttentionSpec": "petals.kv_cache",
    "SlidingWindowSpec": "petals.kv_cache",
    "ServerBlockMixin": "petals.block",
    "load_block": "petals.loading",
    "get_plugin_manager": "petals.plugins",
    "AutoDistributedModelForCausalLM": "petals.client.model",
    "AutoDistributedModel": "petals.client.model",
    "AutoDistributedModelForSequenceClassification": "petals.client.model",
    "RemoteSequential": "petals.client.remote_sequential",
    "InferenceSession": "petals.client.inference_session",
}

__all__ = ["__version__", "hookimpl", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'petals' has no attribute {name!r}")
