"""(m) Sessions a server's cache holds at once, at the same bytes: one arena against a pool per block.

    python -m benchmarks.cache_budget [--quick]

A server's cache budget is bytes (``--attn_cache_tokens`` tokens of each hosted block's kind, summed),
in one arena of equal-byte pages that every block's pool shares (``petals.kv_cache.arena``). Before,
each block had a pool of its own of ``--attn_cache_tokens`` tokens (a state block one sequence per 256
of them), the same bytes in all. For each model's mix of cache kinds (real sizes, bf16, a span of
blocks as a server hosts it), sessions of one sequence are opened and grown to ``L`` tokens in
prefill chunks of 512, by the cache managers as the engine drives them (pages taken, a window's
given back; the tensors are not written), until one no longer fits: how many fit, on the arena and
on pools per block. Transformers' column is what fits the same bytes if each session held what
transformers' own cache holds for it (a full layer every token, a sliding one ``window - 1``, a
linear-attention layer its state once), with no pages, no rollback margin and no snapshots: the floor
no server reaches (measured against ``DynamicCache`` layer by layer in (k) cache_kinds).

Goals: on the arena, never fewer sessions than on pools per block; Gemma 3's long sessions at least
2x. Qwen3-Next's arena/HF is well under 1: its states keep 4 snapshots for rollback (5 states a
sequence, ``petals.kv_cache.states``), and its 10 MiB state page makes its attention pages hold 5,280
tokens each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from benchmarks.harness import Check, Context, Result, main
from petals.kv_cache import LinearAttentionSpec, OutOfPagesError, SlidingWindowSpec
from petals.plugins import get_plugin_manager
from petals.server.backend import BlockBackend
from petals.server.cache_budget import CacheBudget

TOKENS_PER_BLOCK = 8_192  # --attn_cache_tokens: the bytes both layouts get
CHUNK = 512  # prefill tokens per step, as the engine's chunks
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Mix:
    name: str
    config: Callable[[], transformers.PretrainedConfig]
    blocks: int  # the span a server hosts


def _layer_types(blocks: int, every: int, often: str, seldom: str) -> list[str]:
    return [seldom if (index + 1) % every == 0 else often for index in range(blocks)]


MIXES = {
    "llama3": Mix(
        "Llama 3.1 8B (full attention)",
        lambda: transformers.LlamaConfig(
            hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=12
        ),
        12,
    ),
    "gemma3": Mix(
        "Gemma 3 27B (5 sliding 1,024 : 1 full)",
        lambda: transformers.Gemma3TextConfig(
            hidden_size=5376,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            sliding_window=1024,
            num_hidden_layers=12,
            layer_types=_layer_types(12, 6, "sliding_attention", "full_attention"),
        ),  # fmt: skip
        12,
    ),
    "gpt_oss": Mix(
        "GPT-OSS 120B (sliding 128 and full, alternating)",
        lambda: transformers.GptOssConfig(
            hidden_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=128,
            num_hidden_layers=12,
            layer_types=_layer_types(12, 2, "sliding_attention", "full_attention"),
        ),  # fmt: skip
        12,
    ),
    "qwen3_next": Mix(
        "Qwen3-Next 80B (3 linear attention : 1 full)",
        lambda: transformers.Qwen3NextConfig(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            num_hidden_layers=4,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            layer_types=_layer_types(4, 4, "linear_attention", "full_attention"),
        ),  # fmt: skip
        4,
    ),
}


def backends_of(mix: Mix) -> list[BlockBackend]:
    config = mix.config()
    config = get_plugin_manager().family(config.model_type).config_class.from_dict(config.to_dict())
    return [
        BlockBackend(
            f"{config.model_type}.{index}", index, torch.nn.Identity(), config, DTYPE, torch.device("cpu")
        )
        for index in range(mix.blocks)
    ]


def grow(cache, length: int) -> None:
    """``length`` tokens into ``cache`` in chunks, as the engine's steps take and give back its pages."""
    done = 0
    while done < length:
        tokens = min(CHUNK, length - done)
        cache.reserve(tokens)
        cache.advance(tokens)  # what a forward's writes do: move on, give back what the kind no longer needs
        done += tokens


def sessions_that_fit(open_one: Callable[[], list], length: int) -> int:
    """How many sessions of ``length`` tokens fit at once (opened one after another, each grown whole)."""
    held = []
    try:
        while True:
            try:
                caches = open_one()
            except OutOfPagesError:
                break
            held.append(caches)
            try:
                for cache in caches:
                    grow(cache, length)
            except OutOfPagesError:
                held.pop()
                for cache in caches:
                    cache.release()
                break
        return len(held)
    finally:
        for caches in held:
            for cache in caches:
                cache.release()


def on_arena(backends: list[BlockBackend], length: int) -> int:
    budget = CacheBudget(backends, TOKENS_PER_BLOCK)
    return sessions_that_fit(lambda: budget.open_caches(backends, 1, length), length)


def on_pools_per_block(backends: list[BlockBackend], length: int) -> int:
    """The layout before the arena: each block a pool of its own for ``TOKENS_PER_BLOCK`` tokens."""
    pools = {backend.uid: backend.make_pools(TOKENS_PER_BLOCK, 16) for backend in backends}

    def open_one() -> list:
        caches = []
        try:
            for backend in backends:
                caches.append(backend.open_cache(pools[backend.uid], 1, length))
        except BaseException:
            for cache in caches:
                cache.release()
            raise
        return caches

    return sessions_that_fit(open_one, length)


def transformers_bytes(backends: list[BlockBackend], length: int) -> int:
    """What transformers' own cache holds for one session of ``length`` tokens over these blocks."""
    total = 0
    for backend in backends:
        spec = backend.cache_spec
        for part in (spec.attention, spec.state) if hasattr(spec, "state") else (spec,):
            if isinstance(part, LinearAttentionSpec):
                total += part.state_bytes(DTYPE)
            elif isinstance(part, SlidingWindowSpec):
                total += min(length, part.window - 1) * part.bytes_per_token(DTYPE)
            else:
                total += length * part.bytes_per_token(DTYPE)
    return total


def cache_budget(ctx: Context) -> Result:
    lengths = ctx.pick((512, 4_096, 8_192, 32_768), (512, 8_192, 32_768))
    rows, measured = [], {}
    header = f"{'model':<46}  {'tokens':>6}  {'arena':>5}  {'pools':>5}  {'HF':>5}  arena/pools  arena/HF"
    for key, mix in MIXES.items():
        backends = backends_of(mix)
        budget = CacheBudget(backends, TOKENS_PER_BLOCK)
        (arena,) = budget.arenas.values()
        measured[key] = {"budget_bytes": budget.nbytes, "page_bytes": arena.page_nbytes, "lengths": {}}
        for length in lengths:
            ours, before = on_arena(backends, length), on_pools_per_block(backends, length)
            ideal = budget.nbytes // transformers_bytes(backends, length)
            measured[key]["lengths"][str(length)] = {"arena": ours, "pools": before, "hf": ideal}
            rows.append(
                f"{mix.name:<46}  {length:>6,}  {ours:>5}  {before:>5}  {ideal:>5}  "
                f"{_ratio(ours, before):>11}  {_ratio(ours, ideal):>8}"
            )
    long = str(lengths[-2])
    gemma = measured["gemma3"]["lengths"][long]
    worst = min(
        (data["arena"] / data["pools"], key, length)
        for key, values in measured.items()
        for length, data in values["lengths"].items()
        if data["pools"]
    )
    checks = [
        Check(
            f"fewest sessions on the arena / on pools per block: {worst[1]} at {worst[2]} tokens",
            worst[0],
            1.0,
            ">=",
        ),
        Check(
            f"Gemma 3 at {int(long):,} tokens: arena / pools per block",
            gemma["arena"] / max(gemma["pools"], 1),
            2.0,
            ">=",
        ),
    ]
    pages = ", ".join(f"{key} {values['page_bytes'] / 2**10:,.0f} KiB" for key, values in measured.items())
    notes = [header, *rows, f"page sizes: {pages}; budget: {TOKENS_PER_BLOCK:,} tokens of each block's kind"]
    return Result(
        item="m",
        title="Sessions the cache holds at once at the same bytes: one arena vs a pool per block",
        ratio=gemma["arena"] / max(gemma["hf"], 1),
        baseline=f"sessions fitting the same bytes at transformers' own cache sizes, Gemma 3 at {int(long):,} tokens",
        checks=checks,
        measurements=measured,
        settings={"tokens_per_block": TOKENS_PER_BLOCK, "chunk": CHUNK, "dtype": "bfloat16"},
        notes=notes,
    )


def _ratio(ours: int, theirs: int) -> str:
    return f"{ours / theirs:.2f}" if theirs else ("-" if not ours else "inf")


BENCHMARKS = {"cache_budget": cache_budget}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
