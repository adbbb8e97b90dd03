"""``petals plan MODEL``: what one block of MODEL weighs and caches, and how many GPUs the model needs.

It reads config.json only (never weights) and asks ``petals.server.planning.plan_blocks``, the very plan
``petals serve`` chooses its block count with, once per way a server may hold the weights: as the
checkpoint stores them (a quantized release served packed), in ``--dtype``, int8, nf4. The row that
``petals serve`` would pick with the options given is marked.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from petals.cli.errors import PetalsCommand
from petals.cli.options import option
from petals.cli.original_options import parse_size
from petals.server.settings import QUANT_TYPE_CHOICES, WEIGHTS_CHOICES

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from petals.formats import StoredWeights
    from petals.kv_cache import CacheSpec
    from petals.server.planning import BlockPlan

GiB = 1024**3
PLAN_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, eq=False)  # one of each, told apart by identity (StoredWeights holds dicts)
class Holding:
    """One way a server may hold a block's weights: a column of the weights table, a row of the fit."""

    label: str  # "fp8 (128x128 blocks) packed", "bfloat16", "nf4"
    option: str  # what makes ``petals serve`` hold them so
    quant_type: str
    stored: StoredWeights | None = None  # served packed, in the checkpoint's stored bytes


def holdings(stored: StoredWeights | None, dtype: torch.dtype) -> list[Holding]:
    """Packed as stored (a quantized checkpoint), in ``dtype`` (dequantized, for such a checkpoint), int8, nf4."""
    dtype_name = str(dtype).removeprefix("torch.")
    if stored is None:
        plain = [Holding(dtype_name, "--quant_type none", "none")]
    else:
        plain = [
            Holding(f"{stored.name} packed", "--weights packed", "none", stored),
            Holding(f"{dtype_name} dequantized", "--weights dequantized", "none"),
        ]
    return [*plain, Holding("int8", "--quant_type int8", "int8"), Holding("nf4", "--quant_type nf4", "nf4")]


def served_holding(options: Sequence[Holding], quant_type: str | None, weights: str) -> Holding:
    """The holding ``petals serve`` picks on one GPU with these options (``choose_quant_type``,
    ``choose_weights``: nf4 unless told otherwise; a quantized checkpoint packed unless dequantized)."""
    import torch

    from petals.server.planning import choose_quant_type, choose_weights

    quant_type = choose_quant_type(quant_type, torch.device("cuda"))
    packed = choose_weights(weights, quant_type) == "packed"
    candidates = [holding for holding in options if holding.quant_type == quant_type]
    # an unquantized checkpoint has no packed holding: its weights are its dtype's either way
    return next((holding for holding in candidates if packed and holding.stored is not None), candidates[-1])


def plan_lines(
    name: str,
    config: PretrainedConfig,
    plans: dict[Holding, BlockPlan],
    served: Holding,
    sessions: int,
    context: int,
) -> list[str]:
    """Everything ``petals plan`` prints: the weights per block kind, the cache per kind, the fit."""
    any_plan = next(iter(plans.values()))
    stored = next((holding.stored.name for holding in plans if holding.stored is not None), None)
    header = f"{name}: {config.model_type}, {config.num_hidden_layers} blocks, " + (
        f"checkpoint stored as {stored}" if stored else "checkpoint in plain floating point"
    )
    return [
        header,
        "",
        *weight_lines(plans),
        "",
        *cache_lines(any_plan),
        "",
        *fit_lines(plans, served, sessions, context),
    ]


def weight_lines(plans: dict[Holding, BlockPlan]) -> list[str]:
    """Weights per block, blocks of equal weights grouped, in each holding; and all blocks together."""
    per_block = list(zip(*(plan.weight_bytes for plan in plans.values()), strict=True))
    rows = [
        [_blocks(indices), str(len(indices)), *(_gib(size) for size in per_block[indices[0]])]
        for indices in _groups(per_block, key=lambda sizes: sizes)
    ]
    rows.append(["all", str(len(per_block)), *(_gib(sum(plan.weight_bytes)) for plan in plans.values())])
    head = ["blocks", "count", *(holding.label for holding in plans)]
    return ["Weights per block (GiB):", *_table(head, rows)]


def cache_lines(plan: BlockPlan) -> list[str]:
    """Cache per token of each cache kind in the plan's dtype, how many tokens of a sequence it keeps, and
    (where a kind keeps fixed-size states) its bytes per sequence."""
    specs, dtype = plan.cache_specs, plan.dtype
    rows = [
        [
            _blocks(indices),
            str(len(indices)),
            _cache_kind(specs[indices[0]]),
            f"{specs[indices[0]].bytes_per_token(dtype):,}",
            _tokens_kept(specs[indices[0]]),
            f"{specs[indices[0]].bytes_per_sequence(dtype):,}",
        ]
        for indices in _groups(specs, key=_cache_key(dtype))
    ]
    head = ["blocks", "count", "kind", "bytes/token", "tokens kept", "bytes/sequence"]
    if not any(spec.bytes_per_sequence(dtype) for spec in specs):
        head, rows = head[:-1], [row[:-1] for row in rows]  # no fixed-size states
    return [f"KV cache per block ({str(dtype).removeprefix('torch.')}):", *_table(head, rows)]


def fit_lines(plans: dict[Holding, BlockPlan], served: Holding, sessions: int, context: int) -> list[str]:
    """Blocks per GPU as ``petals serve`` plans them, GPUs for one copy, GPUs for ``sessions`` of
    ``context`` tokens (servers whose cache holds them: ``--attn_cache_tokens sessions * context``)."""
    plan = plans[served]
    session_tokens = sessions * context
    what = f"{sessions} session{'s' if sessions > 1 else ''} of {context} tokens"
    rows = []
    for holding, each in plans.items():
        with_sessions = each.holding(session_tokens)
        rows.append(
            [
                ("* " if holding is served else "  ") + holding.label,
                holding.option,
                _count(each.servable_blocks, "block"),
                _gpus(each),
                _gpus(with_sessions, each=True),
            ]
        )
    them, take = ("them", "they take") if sessions > 1 else ("it", "it takes")
    return [
        f"On one GPU of {_gib(plan.memory_bytes)} GiB ({_gib(plan.autograd_bytes)} GiB of it kept for autograd):",
        f"  per GPU: the blocks `petals serve` plans, each with its default cache of {plan.attn_cache_tokens} "
        "tokens",
        "  one copy: GPUs that hold every block once, with those caches",
        f"  {what}: GPUs whose caches hold {them} (servers started with --attn_cache_tokens {session_tokens});",
        f"    {take} {_gib(session_bytes(plan, sessions, context))} GiB of cache over all "
        f"{len(plan.weight_bytes)} blocks",
        *_table(["  weights held as", "petals serve", "per GPU", "one copy", what], rows),
        "* what `petals serve` chooses with these options",
    ]


def session_bytes(plan: BlockPlan, sessions: int, context: int) -> int:
    """What ``sessions`` of ``context`` tokens hold in all blocks' caches: each block keeps the tokens
    its kind keeps (a sliding window its window), and its fixed-size states."""
    return sessions * sum(
        spec.tokens_held(context) * spec.bytes_per_token(plan.dtype) + spec.bytes_per_sequence(plan.dtype)
        for spec in plan.cache_specs
    )


def _gpus(plan: BlockPlan, each: bool = False) -> str:
    """``16 GPUs``, or with ``each`` ``16 GPUs (4 blocks each)``; ``does not fit`` when no block does."""
    count = plan.servers_per_copy
    if count is None:
        return "does not fit"
    return _count(count, "GPU") + (f" ({_count(plan.servable_blocks, 'block')} each)" if each else "")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _cache_key(dtype: torch.dtype) -> Callable[[CacheSpec], Hashable]:
    def key(spec: CacheSpec) -> Hashable:
        return (
            _cache_kind(spec),
            spec.bytes_per_token(dtype),
            spec.bytes_per_sequence(dtype),
            _tokens_kept(spec),
        )

    return key


def _cache_kind(spec: CacheSpec) -> str:
    """The kind, with its heads' widths where it has them: a latent cache shows as one narrow head."""
    heads = getattr(spec, "num_kv_heads", None)
    if heads is None:
        return spec.describe()
    return f"{spec.describe()}, {heads} x ({spec.key_dim} + {spec.value_dim})"


def _tokens_kept(spec: CacheSpec) -> str:
    """How many tokens of a sequence the kind keeps at most ("all" for full attention)."""
    endless = 1 << 40
    kept = spec.tokens_held(endless)
    return "all" if kept == endless else f"{kept:,}"


def _groups(items: Sequence, key: Callable) -> list[list[int]]:
    """Indices of equal items (by ``key``), in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(key(item), []).append(index)
    return list(groups.values())


def _blocks(indices: Sequence[int]) -> str:
    """``0-2``, ``3-60``, ``0, 2, ..., 34`` (every other block), ``1, 4-6``."""
    step = indices[1] - indices[0] if len(indices) > 1 else 1
    if all(b - a == step for a, b in itertools.pairwise(indices)):
        if step == 1:
            return f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])
        if len(indices) > 3:
            return f"{indices[0]}, {indices[1]}, ..., {indices[-1]}"
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:,.2f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns as wide as their widest cell; numbers right-aligned, words left-aligned."""
    columns = list(zip(head, *rows, strict=True))
    widths = [max(map(len, column)) for column in columns]
    numeric = [
        index > 0 and all(cell[:1].isdigit() for cell in column[1:]) for index, column in enumerate(columns)
    ]

    def line(cells: Sequence[str]) -> str:
        aligned = (
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(cells, widths, numeric, strict=True)
        )
        return ("  " + "   ".join(aligned)).rstrip()

    return [line(head), *(line(row) for row in rows)]


@click.command("plan", cls=PetalsCommand)
@click.argument("model")
@option(
    "--gpu_memory",
    default="24GiB",
    show_default=True,
    callback=parse_size,
    help="Memory of one GPU (e.g. 24GiB, 80GB, or bytes; GB != GiB).",
)
@option(
    "--sessions",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Inference sessions the swarm should hold at once.",
)
@option(
    "--context",
    type=click.IntRange(min=1),
    help="Tokens of each session (default: the longest a server allows the model, 8192 with grouped-query "
    "attention, 2048 without).",
)
@option(
    "--quant_type",
    type=click.Choice(QUANT_TYPE_CHOICES),
    help="Weight quantization to mark as served (default: what `petals serve` chooses on a GPU, nf4).",
)
@option(
    "--dtype",
    type=click.Choice(PLAN_DTYPES),
    default="bfloat16",
    show_default=True,
    help="Dtype of the cache and of weights neither quantized nor packed (GPUs serve bfloat16).",
)
@option(
    "--weights",
    type=click.Choice(WEIGHTS_CHOICES),
    default="packed",
    show_default=True,
    help="A quantized checkpoint's weights to mark as served: packed as stored (smaller, dequantized per "
    "forward) or dequantized at load (faster per token); both are shown.",
)
@option("--token", help="Hugging Face token, for a gated model's config.json.")
def plan_command(
    model: str,
    gpu_memory: int,
    sessions: int,
    context: int | None,
    quant_type: str | None,
    dtype: str,
    weights: str,
    token: str | None,
) -> None:
    """How many blocks of MODEL fit on a GPU and how many GPUs it needs, from its config.json alone."""
    from petals.cli.model_files import check_local_path, finding

    check_local_path(model)  # before the slow imports: a typo fails at once
    import torch

    from petals.auto import AutoDistributedConfig
    from petals.formats import StoredWeights
    from petals.server.planning import default_limits, plan_blocks

    with finding(model):
        config = AutoDistributedConfig.from_pretrained(model, token=token)
    serving_dtype = getattr(torch, dtype)
    limits = default_limits(config)
    options = holdings(StoredWeights.of(model, config), serving_dtype)
    plans = {
        holding: plan_blocks(
            config,
            serving_dtype,
            holding.quant_type,
            limits.attn_cache_tokens,
            gpu_memory,
            stored=holding.stored,
        )
        for holding in options
    }
    served = served_holding(options, quant_type, weights)
    context = context or limits.inference_max_length
    for line in plan_lines(model, config, plans, served, sessions, context):
        click.echo(line)
