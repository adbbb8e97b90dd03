"""(k) Bytes one block's cache holds, per cache kind: ours against transformers' ``DynamicCache``.

    python -m benchmarks.cache_kinds [--quick]

For each kind, one real transformers attention layer (a narrow config with the kind's real window
and widths) runs one sequence of 16,384 tokens in steps of 512, twice over the same inputs: into
``DynamicCache(config=...)`` (which picks transformers' own layer for the kind) and into a session's
cache on the block's ``PagePool``, as a server runs it. After each step both are counted:

* ours: the pages the pool has handed out (the session is its only user) times the bytes of one
  page's key and value slots in the pool's tensors;
* transformers': ``nbytes`` of the layer's key and value tensors. A sliding layer's tensors are views
  whose storage also keeps the step's new tokens until the next step: counting the views favours it.

Specs are core's default description of the layer; DeepSeek V3's is what its family's ``cache_spec``
hook returns (its attention caches the latent: ``kv_lora_rank`` values as keys, the shared rope key
as values, one head), and its real layer writing into our cache proves the widths. Lengths are
multiples of the 16-token page; at any other length full attention rounds up to a whole page.
Goals (issue 38): sliding (4,096) at 16,384 tokens <= 1.05x transformers'; keys and values of unequal
widths exact to the byte; linear attention constant in sequence length, where this build serves it.
``--quick`` runs the same lengths in steps of 1,024.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache

from benchmarks.harness import Check, Context, Result, main
from petals.kv_cache import (
    MANAGERS,
    PAGE_TOKENS,
    CacheSpec,
    FullAttentionSpec,
    PagePool,
    describe_block,
    open_cache,
)

LENGTH = 16_384
REPORTED = (1_024, 4_096, LENGTH)  # the lengths the table shows (every step's bytes go to the JSON)
SLIDING_GOAL = 1.05
NARROW = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "attn_implementation": "sdpa",
}


def latent_spec(config: PretrainedConfig, block_index: int) -> CacheSpec:
    """DeepSeek V3's ``cache_spec``: one head of the latent (keys) and of the shared rope key (values)."""
    return FullAttentionSpec(
        num_kv_heads=1,
        key_dim=config.kv_lora_rank,
        value_dim=config.qk_rope_head_dim,
        num_query_heads=config.num_attention_heads,
    )


@dataclass(frozen=True)
class Kind:
    """One row group: a layer of transformers whose cache we hold."""

    name: str
    config: PretrainedConfig
    attention: str  # modeling module's attention and rotary classes, "module.Class"
    rotary: str
    spec_of: Callable[[PretrainedConfig, int], CacheSpec] = describe_block


KINDS = {
    "full": Kind(
        "full attention (Llama: 2 kv heads of 16)",
        transformers.LlamaConfig(**NARROW),
        "llama.LlamaAttention",
        "llama.LlamaRotaryEmbedding",
    ),
    "keys != values": Kind(
        "full, keys 512 != values 64 (DeepSeek V3 latent)",
        transformers.DeepseekV3Config(
            **{**NARROW, "num_attention_heads": 1, "num_key_value_heads": 1},
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=16,
            v_head_dim=16,
            q_lora_rank=None,
        ),
        "deepseek_v3.DeepseekV3Attention",
        "deepseek_v3.DeepseekV3RotaryEmbedding",
        latent_spec,
    ),
    "sliding": Kind(
        "sliding window 4,096 (Mistral)",
        transformers.MistralConfig(**NARROW, sliding_window=4_096),
        "mistral.MistralAttention",
        "mistral.MistralRotaryEmbedding",
    ),
    "chunked": Kind(
        "chunked 8,192 (Llama 4)",
        transformers.Llama4TextConfig(
            **NARROW, head_dim=16, attention_chunk_size=8_192, intermediate_size=64, intermediate_size_mlp=64
        ),
        "llama4.Llama4TextAttention",
        "llama4.Llama4TextRotaryEmbedding",
    ),
}


def modeling_class(name: str) -> type:
    module, cls = name.split(".")
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)


def pool_bytes_taken(pool: PagePool) -> int:
    """Bytes of the key and value slots of every page the pool has handed out."""
    page = slice(0, pool.page_tokens)
    return (pool.num_pages - pool.free_pages) * (pool.keys[page].nbytes + pool.values[page].nbytes)


def dynamic_layer_bytes(cache: DynamicCache) -> int:
    """Bytes of the tensors transformers' cache keeps for its one layer (keys and values, or states)."""
    layer = cache.layers[0]
    if hasattr(layer, "recurrent_states"):
        states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    else:
        states = [layer.keys, layer.values]
    return sum(state.nbytes for state in states if state is not None)


def stepped(
    config: PretrainedConfig,
    step: int,
    forward: Callable[[torch.Tensor, torch.LongTensor], None],
    held: Callable[[], tuple[int, int]],
) -> dict[int, tuple[int, int]]:
    """``{tokens: held()}`` after each ``forward(hidden_states, position_ids)`` of ``step`` tokens."""
    generator = torch.Generator().manual_seed(0)
    counts = {}
    with torch.no_grad():
        for start in range(0, LENGTH, step):
            forward(
                torch.randn(1, step, config.hidden_size, generator=generator),
                torch.arange(start, start + step)[None],
            )
            counts[start + step] = held()
    return counts


def measure(kind: Kind, step: int) -> dict[int, tuple[int, int]]:
    """``{tokens: (our bytes, transformers' bytes)}`` after each step of ``kind``'s layer over one sequence."""
    torch.manual_seed(0)
    attention = modeling_class(kind.attention)(kind.config, 0).eval()
    rotary = modeling_class(kind.rotary)(kind.config)
    spec = kind.spec_of(kind.config, 0)
    pool = PagePool(spec, num_pages=-(-LENGTH // PAGE_TOKENS))
    ours = open_cache(spec, batch_size=1, max_length=LENGTH, pool=pool)
    theirs = DynamicCache(config=kind.config)

    def forward(hidden: torch.Tensor, positions: torch.LongTensor) -> None:
        embeddings = rotary(hidden, positions)
        for cache in (ours.view(), theirs):  # no mask: the bytes, not the outputs, are compared here
            attention(hidden, embeddings, None, cache=cache)

    def held() -> tuple[int, int]:
        taken = pool_bytes_taken(pool)
        if taken != ours.nbytes:
            raise AssertionError(f"{kind.name}: the cache counts {ours.nbytes} bytes, its pages are {taken}")
        return taken, dynamic_layer_bytes(theirs)

    counts = stepped(kind.config, step, forward, held)
    ours.release()
    return counts


def linear_attention_kind() -> type[CacheSpec] | None:
    """The linear-attention spec this build serves, if any."""
    return next((spec for spec in MANAGERS if spec.kind == "linear_attention"), None)


def measure_linear(step: int) -> dict[int, tuple[int, int]]:
    """Qwen3-Next's gated delta net: ``{tokens: (our bytes, transformers' bytes)}`` after each step.

    A fixed-size state takes no pages: ours is the cache's own ``nbytes``, transformers' the bytes of
    its layer's convolution and recurrent states."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        **NARROW,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, 0).eval()
    ours = open_cache(describe_block(config, 0), batch_size=1, max_length=LENGTH)
    theirs = DynamicCache(config=config)

    def forward(hidden: torch.Tensor, positions: torch.LongTensor) -> None:
        for cache in (ours.view(), theirs):
            layer(hidden, cache=cache)

    counts = stepped(config, step, forward, lambda: (ours.nbytes, dynamic_layer_bytes(theirs)))
    ours.release()
    return counts


def table(rows: dict[str, dict[int, tuple[int, int]]]) -> list[str]:
    width = max(len(name) for name in rows)
    lines = [f"{'kind':<{width}}  {'tokens':>6}  {'ours bytes':>11}  {'HF bytes':>11}  ours/HF"]
    for name, held in rows.items():
        for tokens in REPORTED:
            ours, theirs = held[tokens]
            lines.append(f"{name:<{width}}  {tokens:>6,}  {ours:>11,}  {theirs:>11,}  {ours / theirs:.3f}")
    return lines


def cache_kinds(ctx: Context) -> Result:
    step = ctx.pick(512, 1_024)
    measured = {key: measure(kind, step) for key, kind in KINDS.items()}
    rows = {KINDS[key].name: held for key, held in measured.items()}
    linear = linear_attention_kind()
    if linear is not None:
        rows["linear attention (Qwen3-Next)"] = measured["linear"] = measure_linear(step)

    def ratio(key: str, tokens: int = LENGTH) -> float:
        ours, theirs = measured[key][tokens]
        return ours / theirs

    latent_ours, latent_theirs = measured["keys != values"][LENGTH]
    checks = [
        Check("sliding (4,096) at 16,384 tokens: ours / HF", ratio("sliding"), SLIDING_GOAL, "<="),
        Check("chunked (8,192) at 16,384 tokens: ours / HF", ratio("chunked"), SLIDING_GOAL, "<="),
        Check("full attention at 16,384 tokens: ours / HF", ratio("full"), 1.0, "<="),
        Check(
            "keys != values at 16,384 tokens: bytes ours differ from HF's by",
            abs(latent_ours - latent_theirs),
            0,
            "<=",
            unit="bytes",
        ),
    ]
    notes = table(rows)
    if linear is None:
        notes.append("linear attention: not served by this build")
    else:
        growth = measured["linear"][LENGTH][0] / measured["linear"][REPORTED[0]][0]
        checks.append(Check("linear attention: ours at 16,384 / at 1,024 tokens", growth, 1.0, "<="))
    notes.append("lengths are multiples of the 16-token page: full attention holds whole pages exactly")
    return Result(
        item="k",
        title="KV cache bytes per block and kind vs transformers' DynamicCache (1 sequence, fp32)",
        ratio=ratio("sliding"),
        baseline="DynamicCache(config=...)'s key and value tensors of the same layer, sliding (4,096) at 16,384",
        checks=checks,
        measurements={
            key: {str(tokens): {"ours": ours, "hf": theirs} for tokens, (ours, theirs) in held.items()}
            for key, held in measured.items()
        },
        settings={"step_tokens": step, "tokens": LENGTH, "dtype": "float32"},
        notes=notes,
    )


BENCHMARKS = {"cache_kinds": cache_kinds}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
