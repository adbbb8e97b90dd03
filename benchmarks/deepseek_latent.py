"""(l) DeepSeek V3's latent cache: bytes per token per layer, and decode time served (absorbed), transformers, expanded.

    python -m benchmarks.deepseek_latent [--quick]

Bytes: for DeepSeek V3's published sizes (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank
512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; nothing is allocated), what one
layer's cache holds per token: the latent, as core's default ``cache_spec`` reads it from the
attention (one head: the 512-value compressed latent as keys, the 64-value shared rope key as values),
against the expanded keys and values the attention computes from it (128 heads x (192 key + 128 value)
values: what the original Petals, or transformers before it cached the latent, kept).

Time: one layer with V3's head dims and rope (yarn, interleaved) but 16 heads and hidden 2048
(``--quick``: 2 heads, hidden 256), float32, decodes one token at a few context lengths in three
forms, taking turns (one warm-up each, then best of N; each step is rewound, so every sample sees
the same context), each at 1 torch thread and at all of them and credited with the faster (on a
busy machine torch's threads stall when another process takes a core):

* ours: the plugin's served block (``DeepseekV3Block``) with a session's cache on the block's
  ``PagePool``, as a server runs it: the latent is cached, and the attention is absorbed
  (``petals_deepseek.absorbed``): a decode step's queries are multiplied into the latent space by
  ``kv_b_proj``'s key part, scored against the cached latent and rope key, and the weighted latent
  leaves through ``kv_b_proj``'s value part; a prefill chunk of 512 tokens expands instead, as
  transformers does (``absorption_pays`` picks). Which path its steps took is counted and printed;
* transformers: the model's own ``DeepseekV3DecoderLayer`` with ``DynamicCache`` (transformers 5.24
  caches the same latent), the baseline of the ratios;
* expanded: the same weights computing attention over per-head keys and values cached after the
  up-projection (``ExpandedCacheLayer`` below), checked equal to the others within 1e-4 on every
  prefill chunk and decode step before anything is timed.

The layer's MLP is dense and narrow (intermediate 1024) and the same in all three forms; what grows
with the context is attention, where transformers' form pays for the expansion of every cached token
at each step (``kv_lora_rank x heads x (192 + 128)`` multiply-adds per token), the expanded form
reads ``heads x 320`` values per token instead, and ours ``kv_lora_rank + 64`` values per token, with
``heads x (2 x kv_lora_rank + 64)`` multiply-adds per token and a fixed ``heads x kv_lora_rank x 256``
per step (the queries' way into the latent and the output's way out): at short contexts
(``--quick``) that fixed part can make ours slower than the expanded cache.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from benchmarks.harness import Check, Context, Result, _with_threads, interleaved, main, summary
from petals.block import cache_spec, full_model_implementations
from petals.kv_cache import PAGE_TOKENS, CacheSpec, FullAttentionSpec, PagePool, open_cache
from petals.plugins import get_plugin_manager

# DeepSeek V3's (and R1's, Kimi K2's attention) published sizes
V3_ATTENTION = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# its config.json's rope: yarn, scaled 40x from 4,096 positions (the attention's scale follows it)
V3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}
# the timed layer: V3's head dims, ranks and rope, fewer heads and a narrower hidden size
TIMED = {
    **V3_ATTENTION,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 1024,
    "first_k_dense_replace": 1,  # layer 0: a dense MLP, no experts
    "num_hidden_layers": 1,
    "max_position_embeddings": 163_840,
    "rope_parameters": V3_ROPE,
    "vocab_size": 128,
}
QUICK = {
    **TIMED,
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
}
LENGTHS = (512, 2_048, 8_192)
QUICK_LENGTHS = (32, 96)
PREFILL_CHUNK = 512  # prefill in chunks: an [heads, chunk, context] score matrix at a time
ATOL = 1e-4
OURS_GOAL = 1.10  # the served block over transformers' own layer, at the longest context


def deepseek_config(**sizes) -> PretrainedConfig:
    """The deepseek plugin's config class (what a server builds its blocks from) with these sizes."""
    config = get_plugin_manager().family("deepseek_v3").config_class(**sizes)
    # what transformers picks for the full model (the served block's choice too), for its own layer here
    config._attn_implementation = full_model_implementations(config)[0]
    return config


def bytes_per_token() -> tuple[CacheSpec, CacheSpec, list[str]]:
    """DeepSeek V3's latent spec (what servers cache) and expanded spec (its heads' keys and values), and
    their table."""
    config = deepseek_config(**V3_ATTENTION)
    latent = cache_spec(config, 3)
    heads, key, value = config.num_attention_heads, config.qk_head_dim, config.v_head_dim
    expanded = FullAttentionSpec(num_kv_heads=heads, key_dim=key, value_dim=value, num_query_heads=heads)
    widths = (latent.num_kv_heads, latent.key_dim, latent.value_dim)
    if widths != (1, config.kv_lora_rank, config.qk_rope_head_dim):
        raise AssertionError(f"the served spec {latent} is not one head of the latent and the rope key")
    rows = [
        ("latent (served: cache_spec)", latent),
        ("expanded (heads' keys, values)", expanded),
    ]
    lines = [
        f"DeepSeek V3 (hidden {config.hidden_size}, {heads} heads, q_lora {config.q_lora_rank}, kv_lora "
        f"{config.kv_lora_rank}, qk {config.qk_nope_head_dim} + {config.qk_rope_head_dim}, v {value}): cache per "
        "token per layer",
        f"  {'form':<31}  {'spec':<34}  {'values':>6}  {'bf16 bytes':>10}  {'fp32 bytes':>10}",
    ]
    for name, spec in rows:
        shape = f"{spec.num_kv_heads} x (keys {spec.key_dim} + values {spec.value_dim})"
        values = spec.bytes_per_token(torch.float32) // 4
        lines.append(
            f"  {name:<31}  {shape:<34}  {values:>6,}  {spec.bytes_per_token(torch.bfloat16):>10,}  "
            f"{spec.bytes_per_token(torch.float32):>10,}"
        )
    ratio = expanded.bytes_per_token(torch.float32) / latent.bytes_per_token(torch.float32)
    lines.append(f"  expanded / latent: {ratio:.2f}x (tokens of context per GB: latent / expanded the same)")
    return latent, expanded, lines


class ExpandedCacheLayer(torch.nn.Module):
    """A DeepSeek V3 layer whose cache holds per-head keys and values after the up-projection.

    The weights are ``layer``'s; the attention is computed here, as MLA was served before its latent
    was cached: ``kv_b_proj`` expands each token's latent once, when it enters the cache, and each step
    reads ``heads x (qk_nope + qk_rope)`` key and ``heads x v_head_dim`` value values per cached token.
    """

    def __init__(self, layer: DeepseekV3DecoderLayer, rotary: torch.nn.Module, max_length: int) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary
        attention = layer.self_attn
        self.keys = torch.zeros(1, attention.num_heads, max_length, attention.qk_head_dim)
        self.values = torch.zeros(1, attention.num_heads, max_length, attention.v_head_dim)
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values of the cached tokens."""
        return self.keys[:, :, : self.length].nbytes + self.values[:, :, : self.length].nbytes

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        start = self.length
        positions = torch.arange(start, start + hidden_states.shape[1])[None]
        cos, sin = self.rotary(hidden_states, positions)
        layer = self.layer
        hidden_states = hidden_states + self.attention(layer.input_layernorm(hidden_states), cos, sin)
        return hidden_states + layer.mlp(layer.post_attention_layernorm(hidden_states))

    def attention(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.layer.self_attn
        batch, length = hidden_states.shape[:2]
        nope, rope = attn.qk_nope_head_dim, attn.qk_rope_head_dim
        if attn.q_lora_rank is None:
            queries = attn.q_proj(hidden_states)
        else:
            queries = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
        queries = queries.view(batch, length, -1, attn.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = queries.split([nope, rope], dim=-1)
        latent, k_rot = attn.kv_a_proj_with_mqa(hidden_states).split([attn.kv_lora_rank, rope], dim=-1)
        expanded = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(batch, length, -1, nope + attn.v_head_dim)
        k_nope, values = expanded.transpose(1, 2).split([nope, attn.v_head_dim], dim=-1)
        k_rot = k_rot.view(batch, 1, length, rope)
        rotate = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)

        start, end = self.length, self.length + length
        self.keys[:, :, start:end, :nope] = k_nope
        self.keys[:, :, start:end, nope:] = k_rot  # one rope key, shared by every head
        self.values[:, :, start:end] = values
        self.length = end
        # a token sees the cache and the step's tokens up to itself (one new token: all of it)
        mask = None if length == 1 else torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        output = F.scaled_dot_product_attention(
            torch.cat((q_nope, q_rot), dim=-1),
            self.keys[:, :, :end],
            self.values[:, :, :end],
            attn_mask=mask,
            scale=attn.scaling,
        )
        return attn.o_proj(output.transpose(1, 2).reshape(batch, length, -1))

    def rewind(self, position: int) -> None:
        self.length = position


class Forms:
    """The three forms of one layer, with the same weights, each with its own cache of one sequence."""

    def __init__(self, config: PretrainedConfig, max_length: int) -> None:
        torch.manual_seed(0)
        self.config = config
        self.block = config.block_class(config, 0).eval()  # the plugin's served block, layer 0
        self.spec = cache_spec(config, 0)
        self.pool = PagePool(self.spec, num_pages=-(-max_length // PAGE_TOKENS))
        self.cache = open_cache(self.spec, batch_size=1, max_length=max_length, pool=self.pool)

        self.layer = DeepseekV3DecoderLayer(config, 0).eval()  # transformers' own layer
        missing = self.layer.load_state_dict(self.block.state_dict(), strict=False).missing_keys
        if missing:
            raise AssertionError(f"transformers' layer has weights the served block lacks: {missing}")
        self.rotary = type(self.block.rotary_emb)(config)
        self.dynamic = DynamicCache(config=config)

        self.expanded = ExpandedCacheLayer(self.layer, self.rotary, max_length).eval()
        self.paths = Counter()  # {(path, query tokens): steps} of the served block's attention
        attention = self.block.self_attn
        for path in ("absorbed", "expanded"):
            method = getattr(attention, f"_{path}_attention")
            setattr(attention, f"_{path}_attention", self._counted(path, method))

    def _counted(self, path: str, method):
        def counted(q_nope, *args, **kwargs):
            self.paths[path, q_nope.shape[2]] += 1
            return method(q_nope, *args, **kwargs)

        return counted

    @property
    def length(self) -> int:
        return self.cache.position

    def ours(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.block(hidden_states, self.cache.view())

    def transformers(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the full model does for this layer: rotary embeddings, its mask, then the layer."""
        start = self.dynamic.get_seq_length()
        positions = torch.arange(start, start + hidden_states.shape[1])[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=None,
            cache=self.dynamic,
            position_ids=positions,
        )
        return self.layer(
            hidden_states,
            attention_mask=mask,
            position_ids=positions,
            cache=self.dynamic,
            use_cache=True,
            position_embeddings=self.rotary(hidden_states, positions),
        )

    def step(self, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """All three forms' outputs of one step, each on its own cache."""
        outputs = {
            "ours": self.ours(hidden_states),
            "transformers": self.transformers(hidden_states),
            "expanded": self.expanded(hidden_states),
        }
        lengths = {self.cache.position, self.dynamic.get_seq_length(), self.expanded.length}
        if len(lengths) != 1:
            raise AssertionError(f"the three caches hold different lengths: {lengths}")
        return outputs

    def rewind(self, position: int) -> None:
        self.cache.rewind(position)
        if position < self.dynamic.get_seq_length():  # transformers' crop takes how many tokens to drop
            self.dynamic.crop(position - self.dynamic.get_seq_length())
        self.expanded.rewind(position)

    def held_bytes(self) -> dict[str, int]:
        """Bytes each form's cache holds now (ours: its pages; transformers': its latent tensors)."""
        layer = self.dynamic.layers[0]
        return {
            "ours": self.cache.nbytes,
            "transformers": layer.keys.nbytes + layer.values.nbytes,
            "expanded": self.expanded.nbytes,
        }


def largest_difference(outputs: dict[str, torch.Tensor]) -> float:
    reference = outputs["transformers"]
    return max((output - reference).abs().max().item() for output in outputs.values())


def measure(config: PretrainedConfig, lengths: tuple[int, ...], repeats: int) -> dict[int, dict]:
    """``{context: {seconds per form, bytes per form, largest difference}}``: the forms prefill to each
    context in turn, are checked equal, then each decodes one token (rewound after each) ``repeats`` times."""
    forms = Forms(config, max(lengths) + 1)
    thread_counts = sorted({1, torch.get_num_threads()})
    generator = torch.Generator().manual_seed(0)

    def hidden(tokens: int) -> torch.Tensor:
        return torch.randn(1, tokens, config.hidden_size, generator=generator)

    measured = {}
    worst = 0.0
    with torch.no_grad():
        for length in lengths:
            forms.paths.clear()
            while forms.length < length:
                worst = max(
                    worst, largest_difference(forms.step(hidden(min(PREFILL_CHUNK, length - forms.length))))
                )
            held = forms.held_bytes()
            prefill_paths = {
                f"{path}, {tokens} tokens": steps for (path, tokens), steps in forms.paths.items()
            }
            forms.paths.clear()
            token = hidden(1)
            worst = max(worst, largest_difference(forms.step(token)))  # a decode step, then rewound
            forms.rewind(length)
            (decode_path,) = {path for path, _ in forms.paths}
            if worst > ATOL:
                raise AssertionError(f"the three forms differ by {worst:.3g} > {ATOL} at {length} tokens")

            def decode(form, token=token, length=length):
                def run() -> None:
                    form(token)
                    forms.rewind(length)

                return run

            runs = {"ours": forms.ours, "transformers": forms.transformers, "expanded": forms.expanded}
            samples = interleaved(
                {
                    (name, count): _with_threads(decode(form), count)
                    for name, form in runs.items()
                    for count in thread_counts
                },
                repeats,
            )
            timed = {key: summary(values) for key, values in samples.items()}
            measured[length] = {
                "seconds": {
                    name: min(
                        ({**timed[name, count], "threads": count} for count in thread_counts),
                        key=lambda result: result["best"],
                    )
                    for name in runs
                },
                "bytes": held,
                "max_abs_diff": worst,
                # the attention paths ours took (per layer call) to this context, and for the decode step
                "ours_paths": {"prefill": prefill_paths, "decode": decode_path},
            }
    forms.cache.release()
    return measured


def timing_table(config: PretrainedConfig, measured: dict[int, dict]) -> list[str]:
    threads = sorted({1, torch.get_num_threads()})
    lines = [
        f"decode, one layer with V3's head dims and rope, {config.num_attention_heads} heads, hidden "
        f"{config.hidden_size}, fp32, the faster of {' and '.join(map(str, threads))} threads: ms per token "
        "(best), cache MiB",
        f"  {'context':>7}  {'ours':>8}  {'HF':>8}  {'expanded':>8}  {'ours/HF':>7}  {'exp/HF':>7}  "
        f"{'ours/exp':>8}  {'ours MiB':>8}  {'HF MiB':>7}  {'exp MiB':>8}",
    ]
    for length, row in measured.items():
        best = {form: values["best"] for form, values in row["seconds"].items()}
        mib = {form: value / 2**20 for form, value in row["bytes"].items()}
        lines.append(
            f"  {length:>7,}  {best['ours'] * 1e3:>8.2f}  {best['transformers'] * 1e3:>8.2f}  "
            f"{best['expanded'] * 1e3:>8.2f}  {best['ours'] / best['transformers']:>7.2f}  "
            f"{best['expanded'] / best['transformers']:>7.2f}  {best['ours'] / best['expanded']:>8.2f}  "
            f"{mib['ours']:>8.2f}  {mib['transformers']:>7.2f}  {mib['expanded']:>8.2f}"
        )
    worst = max(row["max_abs_diff"] for row in measured.values())
    lines.append(f"  the three forms' outputs, every prefill chunk and decode step: max |diff| {worst:.2g}")
    for length, row in measured.items():
        paths = row["ours_paths"]
        prefill = "; ".join(f"{name}: {steps}" for name, steps in sorted(paths["prefill"].items()))
        lines.append(f"  ours' attention to {length:,} tokens: prefill {prefill}; decode {paths['decode']}")
    return lines


def deepseek_latent(ctx: Context) -> Result:
    latent, expanded, notes = bytes_per_token()
    config = deepseek_config(**ctx.pick(TIMED, QUICK))
    lengths = ctx.pick(LENGTHS, QUICK_LENGTHS)
    measured = measure(config, lengths, ctx.pick(9, 1))
    notes += timing_table(config, measured)

    longest = measured[lengths[-1]]
    best = {form: values["best"] for form, values in longest["seconds"].items()}
    ours_vs_hf = best["ours"] / best["transformers"]
    byte_ratio = expanded.bytes_per_token(torch.float32) / latent.bytes_per_token(torch.float32)
    checks = [
        Check("DeepSeek V3 cache per token per layer: expanded / latent", byte_ratio, 71.0, ">="),
        Check(
            f"decode at {lengths[-1]:,} tokens: ours (absorbed) / transformers", ours_vs_hf, OURS_GOAL, "<="
        ),
        Check(
            f"decode at {lengths[-1]:,} tokens: ours / expanded cache (reported)",
            best["ours"] / best["expanded"],
            0.0,
            ">=",
        ),
        Check(
            "latent vs expanded vs transformers outputs: max |diff|",
            max(row["max_abs_diff"] for row in measured.values()),
            ATOL,
            "<=",
            unit="",
        ),
    ]
    return Result(
        item="l",
        title="DeepSeek V3 latent cache: bytes per token per layer, decode time absorbed vs HF vs expanded (fp32)",
        ratio=ours_vs_hf,
        baseline=f"transformers' DeepseekV3DecoderLayer with DynamicCache, one token at {lengths[-1]:,} tokens",
        checks=checks,
        measurements={
            "bytes_per_token": {
                "latent": {
                    str(dtype): latent.bytes_per_token(dtype) for dtype in (torch.bfloat16, torch.float32)
                },
                "expanded": {
                    str(dtype): expanded.bytes_per_token(dtype) for dtype in (torch.bfloat16, torch.float32)
                },
            },
            "decode": {str(length): row for length, row in measured.items()},
        },
        settings={
            "timed_layer": {
                key: value for key, value in ctx.pick(TIMED, QUICK).items() if key != "rope_parameters"
            },
            "rope_parameters": V3_ROPE,
            "lengths": list(lengths),
            "dtype": "float32",
            "threads": torch.get_num_threads(),
        },
        notes=notes,
    )


BENCHMARKS = {"deepseek_latent": deepseek_latent}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
