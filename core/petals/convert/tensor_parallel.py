"""Shard one block across several devices with the ``tensor_parallel`` library.

Each family's plugin gives the sharding plan (``tensor_parallel_config`` hook): attention split
by whole key/value groups, MLPs (and experts) by columns then rows, row-parallel outputs summed
across shards. ``TensorParallelBlock`` runs the shards side by side, each with its own
session cache holding only its heads (``petals.kv_cache.ShardCaches``: pages of a pool per shard on a
server), through ``tensor_parallel``'s thread-parallel apply (its
built-in KV-cache handling shares one cache between shards, which is wrong, so it is not used).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig

from petals.block import cache_spec
from petals.plugins import get_plugin_manager


class TensorParallelBlock(nn.Module):
    """A block sharded over ``devices``: ``forward(hidden_states, caches=None)`` with one cache per shard."""

    def __init__(
        self, block: nn.Module, config: PretrainedConfig, devices: Sequence[torch.device | str]
    ) -> None:
        super().__init__()
        import tensor_parallel as tp

        self.devices = [torch.device(device) for device in devices]
        # what each shard caches: refuses, in one line, heads that do not split over the devices
        spec = cache_spec(config, getattr(block, "block_index", 0))
        if not hasattr(spec, "sharded"):  # a fixed-size state (or a layer with one) has no heads split yet
            raise NotImplementedError(
                f"model type {config.model_type!r}: a {spec.describe()} cache cannot be split over devices "
                "yet; serve it without --tensor_parallel_devices"
            )
        self.shard_spec = spec.sharded(len(self.devices))
        plan = (
            get_plugin_manager()
            .family_hooks(config)
            .tensor_parallel_config(config=config, world_size=len(self.devices))
        )
        if plan is None:
            raise NotImplementedError(
                f"model type {config.model_type!r} ({spec.describe()} cache): its plugin gives no tensor-parallel "
                "plan (hook tensor_parallel_config); serve it without --tensor_parallel_devices"
            )
        # sharded=False: weights not split stay whole on every shard (no ZeRO-3 gathering outside the wrapper)
        self.module = tp.TensorParallel(block, self.devices, tensor_parallel_config=plan, sharded=False)
        self.config = config

    @property
    def shards(self) -> nn.ModuleList:
        return self.module.module_shards

    def forward(self, hidden_states: torch.Tensor, caches: Sequence | None = None) -> torch.Tensor:
        from tensor_parallel.tensor_parallel import parallel_apply_simple

        if caches is not None and len(caches) != len(self.devices):
            raise ValueError(f"expected one cache per shard ({len(self.devices)}), got {len(caches)}")
        inputs = [(hidden_states.to(device, non_blocking=True),) for device in self.devices]
        kwargs = [{"cache": cache} for cache in (caches or [None] * len(self.devices))]
        outputs = parallel_apply_simple(self.shards, inputs, kwargs, self.devices)
        return outputs[0].to(hidden_states.device)  # every shard holds the all-reduced result


def make_tensor_parallel(
    block: nn.Module, config: PretrainedConfig, devices: Sequence[torch.device | str]
) -> TensorParallelBlock:
    """Shard ``block`` over ``devices`` (e.g. ``["cuda:0", "cuda:1"]``; ``["cpu", "cpu"]`` in tests)."""
    return TensorParallelBlock(block, config, devices)


def split_heads_of_batch(tensor: torch.Tensor | None, *, rank: int, num_heads: int, world_size: int):
    """This shard's heads of a per-head input: ``[batch * heads, ...]`` (ALiBi) or ``[batch, heads, ...]`` (masks).

    For plugins' ``input_rules``; broadcast tensors (one head) and None pass through.
    """
    if tensor is None:
        return None
    if tensor.ndim == 4:
        return tensor if tensor.shape[1] == 1 else tensor.tensor_split(world_size, dim=1)[rank]
    per_head = tensor.reshape(-1, num_heads, *tensor.shape[1:])
    return per_head.tensor_split(world_size, dim=1)[rank].reshape(-1, *tensor.shape[1:])


def head_splitter(num_heads: int, world_size: int):
    """An ``input_rules`` action giving each shard its heads of an ALiBi bias or per-head mask."""
    return partial(split_heads_of_batch, num_heads=num_heads, world_size=world_size)


def projection_attention_rules(
    config: PretrainedConfig, world_size: int, attention: str = "self_attn"
) -> dict:
    """``state_rules`` for attention with separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (GQA aware).

    Each shard gets whole key/value groups: its key/value heads and the query heads that use them.
    """
    from tensor_parallel.state_actions import Scale, SplitInChunks

    spec = cache_spec(config, 0)
    queries = spec.group_size * spec.key_dim
    rules = {
        rf".*{attention}\.q_proj\.(weight|bias)$": SplitInChunks(world_size, dim=0, chunk_size=queries),
        rf".*{attention}\.k_proj\.(weight|bias)$": SplitInChunks(world_size, dim=0, chunk_size=spec.key_dim),
        rf".*{attention}\.v_proj\.(weight|bias)$": SplitInChunks(
            world_size, dim=0, chunk_size=spec.value_dim
        ),
        rf".*{attention}\.o_proj\.weight$": SplitInChunks(
            world_size, dim=1, chunk_size=spec.group_size * spec.value_dim
        ),
    }
    if getattr(config, "attention_bias", False):
        rules[rf".*{attention}\.o_proj\.bias$"] = Scale(world_size)  # added once after the sum
    return rules
