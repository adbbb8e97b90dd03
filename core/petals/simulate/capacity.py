"""A scenario's GPU kinds sized for its model by the plan ``petals serve`` chooses its block count with.

``petals simulate --model MODEL`` (or the scenario key ``model``) reads MODEL's config.json, never its
weights, and asks ``petals.server.planning.plan_blocks`` what a server started with ``petals serve``'s
defaults on a GPU (nf4 and bfloat16, the checkpoint's stored bytes where it is served packed, the
model's default cache of ``attn_cache_tokens`` per block) holds on each kind's ``memory_gib``: its
``max_blocks`` is the blocks that server hosts, its ``cache_sessions`` the sessions of
``session_tokens_max`` tokens that its per-block cache holds. The scenario's ``blocks`` becomes the
model's. What ``petals plan MODEL --gpu-memory NGiB`` prints as blocks per GPU is the same number.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from petals.simulate.scenario import GpuKind, Scenario

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from petals.server.planning import BlockPlan

GiB = 1024**3


def with_model_capacities(scenario: Scenario) -> Scenario:
    """``scenario`` with the model's ``blocks``, and each kind that gives ``memory_gib`` planned for
    ``scenario.model`` (its ``planned_for`` says so: planning again changes nothing); kinds without a
    memory keep their typed numbers. ValueError when a kind holds no block or no session."""
    model = scenario.model
    to_plan = [kind for kind in scenario.gpus if _to_plan(kind, model)]
    if model is None or (not to_plan and any(kind.planned_for == model for kind in scenario.gpus)):
        return scenario
    from petals.auto import AutoDistributedConfig
    from petals.cli.model_files import finding

    with finding(model):
        config = AutoDistributedConfig.from_pretrained(model)
    kinds = scenario.gpus
    if to_plan:
        plan = serve_plan(model, config)
        kinds = tuple(_planned(kind, plan, scenario) if _to_plan(kind, model) else kind for kind in kinds)
    return dataclasses.replace(scenario, blocks=config.num_hidden_layers, gpus=kinds)


def serve_plan(model: str, config: PretrainedConfig) -> BlockPlan:
    """The plan of a server started with ``petals serve``'s defaults on a GPU, for any memory (set
    ``memory_bytes``): its dtype and quantization, its weights packed where it keeps them so, its default
    cache per block."""
    import torch

    from petals.formats import StoredWeights
    from petals.server.planning import (
        choose_dtype,
        choose_quant_type,
        choose_weights,
        default_limits,
        plan_blocks,
    )

    gpu = torch.device("cuda")
    quant_type = choose_quant_type(None, gpu)
    packed = choose_weights("packed", quant_type) == "packed"
    return plan_blocks(
        config,
        choose_dtype("auto", config, gpu),
        quant_type,
        default_limits(config).attn_cache_tokens,
        memory_bytes=0,
        stored=StoredWeights.of(model, config) if packed else None,
    )


def _to_plan(kind: GpuKind, model: str | None) -> bool:
    return model is not None and kind.memory_gib is not None and kind.planned_for != model


def _planned(kind: GpuKind, plan: BlockPlan, scenario: Scenario) -> GpuKind:
    """``kind`` sized by ``plan`` on its own memory."""
    on_kind = dataclasses.replace(plan, memory_bytes=int(kind.memory_gib * GiB))
    sessions = on_kind.attn_cache_tokens // scenario.session_tokens_max
    if on_kind.servable_blocks < 1 or sessions < 1:
        what = (
            "no block"
            if on_kind.servable_blocks < 1
            else f"no session of {scenario.session_tokens_max} tokens"
        )
        raise ValueError(
            f"gpu kind {kind.name!r} ({kind.memory_gib:g} GiB) holds {what} of {scenario.model} "
            f"({on_kind.explanation}): give it share 0, more memory_gib, or lower session_tokens_max"
        )
    return dataclasses.replace(
        kind, max_blocks=on_kind.servable_blocks, cache_sessions=sessions, planned_for=scenario.model
    )
