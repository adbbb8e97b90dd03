"""(q) One block held packed (quantized checkpoint bytes: dequantized per forward, or computed by torch's
CPU int4 kernel where it takes them) against the same block dequantized at load, and against
transformers' own layer: decode and prefill speed, bfloat16.

    python -m benchmarks.packed_speed [--quick]

Three one-layer models, random weights (``--quick``: the same kinds at hidden 256 and 128):

* dense: a Llama layer (hidden 1024, intermediate 2816, 8 heads of 128, 4 kv heads), where the
  matmuls of seven weights are the step;
* MoE: a Qwen3-MoE layer (hidden 1024, 32 experts of intermediate 512, top-4), its experts stored
  one linear each (``experts.0.gate_proj.weight``, ...), as the releases store them;
* GPT-OSS: a GPT-OSS layer (hidden 1024, 32 experts of intermediate 512, top-4, full attention),
  its experts fused, as OpenAI publishes them.

Each is saved in bfloat16 and written again in each format petals keeps packed (``quantized_checkpoints``:
FP8 in 128x128 blocks, DeepSeek's layout, for dense and MoE; GPTQ int4, groups of 128, for dense and
MoE; a GGUF file in Q4_K for dense; MXFP4 for GPT-OSS's experts). Per format, block 0 is loaded as a
server does (``load_block``) twice: packed (``--weights packed``, the default) and dequantized at load
(``--weights dequantized``), the baseline of the format's ratio. nf4 is ``--quant_type nf4``
(``quantize_block``) applied to the bfloat16 block, whose baseline is that bfloat16 block.
transformers' own decoder layer (bfloat16, with ``DynamicCache``, its rotary embeddings and mask,
experts as transformers runs them) is every row's second baseline. ``SKIPPED`` says what is left out.

Every form runs with a session's cache (served blocks: ``allocate_cache``, the block's real server
cache; transformers: ``DynamicCache``): a prompt of 384 tokens is prefilled, then decode is one token
with 384 cached (rewound after each step), prefill is 128 tokens into an empty cache. Forms take turns
(one warm-up each, then the best of N), each at 1 torch thread and at all of them, credited with the
faster (on a busy machine torch's threads stall when another process takes a core). The prompt's
outputs are compared first: each form's update against the bfloat16 block's (the format's error, which
also checks the writers) and against its baseline's.

Then a few decode steps of each packed form run at one thread with its packed weights metered (the
fastest is kept): the time spent dequantizing (``expert``, ``dequantize``) and how many experts each
3-D weight dequantized (an MoE step must dequantize only its routed experts: at most top-k per token).
The rest of a packed form's excess over its dequantized twin is what dequantizing leaves behind
(allocations, the copies joining experts' parts).

Goals (issue 55): 4-bit integer formats (GPTQ, GGUF Q4_K) no slower than the dense block at decode
(their linears run the int4 kernel in bfloat16, up to ``int4pack.MAX_ROWS`` rows: prefill's 128 too;
an MoE's routed experts are dequantized, as ``weight[e]`` gives transformers' experts loop a dense
tensor); MoE blocks in FP8 and MXFP4 within 1.5x at decode (only routed experts dequantized); dense
FP8 reported.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig, PretrainedConfig, Qwen3MoeConfig
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask

from benchmarks import quantized_checkpoints
from benchmarks.harness import Check, Context, Result, _with_threads, interleaved, main, summary
from petals.block import allocate_cache
from petals.convert import block_weight_bytes, quantize_block
from petals.formats.packed import packed_weights
from petals.loading import load_block

DTYPE = torch.bfloat16
CONTEXT, PREFILL = 384, 128
QUICK_CONTEXT, QUICK_PREFILL = 32, 16
WRITERS = {  # format: (dense checkpoint, folder) -> the quantized checkpoint
    "fp8": functools.partial(
        quantized_checkpoints.write_quantized, quantize=quantized_checkpoints.fp8_blockwise
    ),
    "gptq": functools.partial(
        quantized_checkpoints.write_quantized, quantize=quantized_checkpoints.gptq_int4
    ),
    "mxfp4": functools.partial(
        quantized_checkpoints.write_quantized, quantize=quantized_checkpoints.mxfp4_experts
    ),
    "gguf-q4_k": quantized_checkpoints.write_gguf_llama,
}
INT4_FORMATS = ("gptq", "gguf-q4_k")
SKIPPED = {
    "moe gguf-q4_k": "no GGUF writer for an MoE architecture here (the dense Llama's is llama.cpp's llama layout)"
}
INT4_GOAL = 1.0  # 4-bit integer formats (INT4_FORMATS) packed / dequantized at load, decode
MOE_GOAL = 1.5  # MoE FP8 and MXFP4 packed / dequantized at load, decode


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    config_class: type[PretrainedConfig]
    sizes: dict[str, Any]  # what the timed layer sets (and the table prints)
    quick_sizes: dict[str, Any]
    formats: tuple[str, ...]
    moe: bool

    def config(self, quick: bool) -> PretrainedConfig:
        extra = {"layer_types": ["full_attention"]} if self.config_class is GptOssConfig else {}
        sizes = self.quick_sizes if quick else self.sizes
        return self.config_class(num_hidden_layers=1, vocab_size=128, **sizes, **extra)


HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128}
QUICK_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
QUICK_EXPERTS = {"hidden_size": 128, **QUICK_HEADS}
FAMILIES = (
    Family(
        "dense",
        "Llama",
        LlamaConfig,
        {"hidden_size": 1024, "intermediate_size": 2816, **HEADS},
        {"hidden_size": 256, "intermediate_size": 512, **QUICK_HEADS, "num_attention_heads": 4},  # 4 x 64
        ("fp8", "gptq", "gguf-q4_k", "nf4"),
        moe=False,
    ),
    Family(
        "moe",
        "Qwen3-MoE",
        Qwen3MoeConfig,
        {
            "hidden_size": 1024,
            "moe_intermediate_size": 512,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            **HEADS,
        },
        {"moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, **QUICK_EXPERTS},
        ("fp8", "gptq", "nf4"),
        moe=True,
    ),
    Family(
        "gpt-oss",
        "GPT-OSS",
        GptOssConfig,
        {
            "hidden_size": 1024,
            "intermediate_size": 512,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
        {"intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2, **QUICK_EXPERTS},
        ("mxfp4", "nf4"),
        moe=True,
    ),
)


# ---- the forms of one block ----------------------------------------------------------------------


class ServedForm:
    """A served block with one session's cache, as a server runs it."""

    def __init__(self, block: torch.nn.Module, max_length: int) -> None:
        self.block = block
        self.cache = allocate_cache(block.config, 1, max_length, DTYPE)

    def step(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.block(hidden_states, self.cache.view())

    def rewind(self, position: int) -> None:
        self.cache.rewind(position)

    @property
    def weight_bytes(self) -> int:
        return block_weight_bytes(self.block)


class TransformersForm:
    """transformers' own decoder layer with ``DynamicCache``: rotary embeddings, mask, then the layer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layer, self.rotary, self.config = model.model.layers[0], model.model.rotary_emb, model.config
        self.cache = DynamicCache(config=model.config)

    def step(self, hidden_states: torch.Tensor) -> torch.Tensor:
        start = self.cache.get_seq_length()
        positions = torch.arange(start, start + hidden_states.shape[1])[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=None,
            cache=self.cache,
            position_ids=positions,
        )
        output = self.layer(
            hidden_states,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            position_embeddings=self.rotary(hidden_states, positions),
        )
        return output[0] if isinstance(output, tuple) else output

    def rewind(self, position: int) -> None:
        if position < self.cache.get_seq_length():  # transformers' crop takes how many tokens to drop
            self.cache.crop(position - self.cache.get_seq_length())

    @property
    def weight_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.layer.state_dict().values())


def build_forms(family: Family, config: PretrainedConfig, root: Path, max_length: int) -> dict[str, Any]:
    """``{form name: form}``: transformers, the bfloat16 block, and per format its packed and dequantized
    blocks (nf4: one block, quantized from the bfloat16 one)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPE).eval()
    dense = root / "bf16"
    model.save_pretrained(dense)
    bf16_block = load_block(dense, 0, DTYPE)
    forms: dict[str, Any] = {
        "transformers": TransformersForm(model),
        "bf16": ServedForm(bf16_block, max_length),
    }
    for fmt in family.formats:
        if fmt == "nf4":
            block = quantize_block(copy.deepcopy(bf16_block), "nf4", compute_dtype=DTYPE)
            forms["nf4"] = ServedForm(block, max_length)
            continue
        path = WRITERS[fmt](dense, root / fmt)
        for weights in ("packed", "dequantized"):
            forms[f"{fmt} {weights}"] = ServedForm(load_block(path, 0, DTYPE, weights=weights), max_length)
    return forms


def baseline_of(form: str) -> str | None:
    """The form a form's own ratio divides by: a packed block's dequantized twin; nf4's bfloat16 block."""
    if form.endswith(" packed"):
        return form.replace(" packed", " dequantized")
    return "bf16" if form == "nf4" else None


# ---- measuring -----------------------------------------------------------------------------------


@contextlib.contextmanager
def metered(block: torch.nn.Module) -> Iterator[dict[str, float]]:
    """Within: each outermost packed weight of ``block`` counts and times its dequantizations, into the
    record yielded: ``experts`` (one expert of a 3-D weight, ``expert``) and ``whole`` (a whole weight,
    ``dequantize``: a linear's per forward), each with its ``_seconds``."""
    weights = list(packed_weights(block).values())
    record = {"experts": 0, "experts_seconds": 0.0, "whole": 0, "whole_seconds": 0.0}
    record["expert_weights"] = sum(weight.ndim == 3 for weight in weights)

    def timed(method: Callable, key: str) -> Callable:
        def call(*args):
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                record[f"{key}_seconds"] += time.perf_counter() - started
                record[key] += 1

        return call

    for weight in weights:
        weight.expert, weight.dequantize = timed(weight.expert, "experts"), timed(weight.dequantize, "whole")
    try:
        yield record
    finally:
        for weight in weights:
            del weight.expert, weight.dequantize


def metered_step(form: ServedForm, token: torch.Tensor, context: int, repeats: int = 3) -> dict[str, float]:
    """The fastest of a few metered decode steps (``metered``) at one torch thread (the least disturbed by
    other processes on a busy machine), with the step's own time."""
    records = []
    for _ in range(repeats):
        with metered(form.block) as record:
            started = time.perf_counter()
            _with_threads(lambda: form.step(token), 1)()
            record["step_seconds"] = time.perf_counter() - started
        form.rewind(context)
        records.append(record)
    return min(records, key=lambda record: record["step_seconds"])


def measure_family(family: Family, ctx: Context) -> dict[str, Any]:
    """Every form of ``family``'s block: its weights, its error, its decode and prefill times, and where
    a packed form's decode step goes."""
    config = family.config(ctx.quick)
    context, prefill = ctx.pick((CONTEXT, PREFILL), (QUICK_CONTEXT, QUICK_PREFILL))
    repeats = ctx.pick({"decode": 21, "prefill": 3}, {"decode": 1, "prefill": 1})
    forms = build_forms(family, config, ctx.workdir / family.name, context + prefill + 1)
    generator = torch.Generator().manual_seed(1)
    prompt, token, chunk = (
        torch.randn(1, tokens, config.hidden_size, generator=generator).to(DTYPE)
        for tokens in (context, 1, prefill)
    )
    runs = {
        "decode": {
            name: lambda form=form: (form.step(token), form.rewind(context)) for name, form in forms.items()
        },
        "prefill": {
            name: lambda form=form: (form.rewind(0), form.step(chunk)) for name, form in forms.items()
        },
    }
    with torch.inference_mode():
        measured = prefilled(forms, prompt)
        for phase, phase_runs in runs.items():
            for name, row in timed(phase_runs, repeats[phase]).items():
                measured[name][phase] = row
            if (
                phase == "decode"
            ):  # the cache holds the prompt: meter one more decode step of each packed form
                for name, form in forms.items():
                    if isinstance(form, ServedForm) and packed_weights(form.block):
                        measured[name]["decode_dequantization"] = metered_step(form, token, context)
    for row in measured.values():
        row["prefill"]["tokens_per_second"] = prefill / row["prefill"]["best"]
    return {
        "config": ctx.pick(family.sizes, family.quick_sizes),
        "context": context,
        "prefill_tokens": prefill,
        "forms": measured,
    }


def prefilled(forms: dict[str, Any], prompt: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Each form's weight bytes, and how its output on ``prompt`` (now in its cache) differs: its update's
    relative error against the bfloat16 block's, and its largest difference from its baseline's output."""
    outputs = {name: form.step(prompt).float() for name, form in forms.items()}
    measured = {}
    for name, form in forms.items():
        measured[name] = {
            "weight_bytes": form.weight_bytes,
            "update_error_vs_bf16": relative_error(outputs[name], outputs["bf16"], prompt),
        }
        if baseline_of(name) is not None:
            difference = (outputs[name] - outputs[baseline_of(name)]).abs().max().item()
            measured[name]["max_abs_diff_vs_baseline"] = difference
    return measured


def timed(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, Any]]:
    """``interleaved`` timings of each run at 1 torch thread and at all of them, credited with the faster."""
    counts = sorted({1, torch.get_num_threads()})
    samples = interleaved(
        {(name, count): _with_threads(run, count) for name, run in runs.items() for count in counts}, repeats
    )
    return {
        name: min(
            ({**summary(samples[name, count]), "threads": count} for count in counts),
            key=lambda row: row["best"],
        )
        for name in runs
    }


def relative_error(output: torch.Tensor, reference: torch.Tensor, inputs: torch.Tensor) -> float:
    """``‖Δy − Δy_bf16‖ / ‖Δy_bf16‖`` on the block's update ``Δy = y − x`` (the residual would hide it)."""
    update, expected = output - inputs.float(), reference - inputs.float()
    return ((update - expected).norm() / expected.norm()).item()


# ---- reporting -----------------------------------------------------------------------------------


def family_table(family: Family, result: dict[str, Any]) -> list[str]:
    config = result["config"]
    sizes = ", ".join(f"{key} {value}" for key, value in config.items())
    lines = [
        f"{family.name}: {family.title} ({sizes}), bfloat16; decode with {result['context']} tokens cached, "
        f"prefill {result['prefill_tokens']} tokens; best of N, faster of 1 and all threads (thr)",
        f"  {'form':<21} {'decode ms':>9} {'/base':>6} {'/HF':>6} {'thr':>3}  {'prefill tok/s':>13} {'/base':>6} "
        f"{'/HF':>6}  {'weights MiB':>11}  {'err vs bf16':>11}  dequantized per decode step",
    ]
    forms = result["forms"]
    hf = forms["transformers"]
    for name, row in forms.items():
        base = forms.get(baseline_of(name) or "")
        decode, prefill = row["decode"]["best"], row["prefill"]["best"]
        over_base = (
            (f"{decode / base['decode']['best']:>6.2f}", f"{prefill / base['prefill']['best']:>6.2f}")
            if base
            else ("-",) * 2
        )
        lines.append(
            f"  {name:<21} {decode * 1e3:>9.2f} {over_base[0]:>6} {decode / hf['decode']['best']:>6.2f} "
            f"{row['decode']['threads']:>3}  {row['prefill']['tokens_per_second']:>13,.0f} {over_base[1]:>6} "
            f"{prefill / hf['prefill']['best']:>6.2f}  {row['weight_bytes'] / 2**20:>11.1f}  "
            f"{row['update_error_vs_bf16']:>11.4f}  {dequantization_note(row, config)}"
        )
    return lines


def dequantization_note(row: dict[str, Any], config: dict[str, Any]) -> str:
    """Where a metered decode step of a packed form went: the whole weights' and the experts' dequantizing."""
    record = row.get("decode_dequantization")
    if record is None:
        return ""
    parts = [f"step {record['step_seconds'] * 1e3:.2f} ms"]
    if not record["whole"] and not record["experts"]:
        parts.append("nothing dequantized (a kernel reads the packed weights)")
    if record["whole"]:
        parts.append(f"{record['whole']} whole weights {record['whole_seconds'] * 1e3:.2f} ms")
    if record["expert_weights"]:
        experts = config.get("num_experts") or config.get("num_local_experts")
        routed = record["experts"] / record["expert_weights"]
        parts.append(
            f"{routed:g} of {experts} experts x {record['expert_weights']} {record['experts_seconds'] * 1e3:.2f} ms"
        )
    return "; ".join(parts)


def decode_ratio(results: dict[str, Any], family: str, form: str) -> float:
    forms = results[family]["forms"]
    return forms[form]["decode"]["best"] / forms[baseline_of(form)]["decode"]["best"]


def checks_of(results: dict[str, Any]) -> list[Check]:
    """Per packed form: its decode ratio against its goal, and that its experts were dequantized as routed."""
    checks = []
    for family in FAMILIES:
        forms = results[family.name]["forms"]
        for form in (name for name in forms if name.endswith(" packed")):
            fmt = form.removesuffix(" packed")
            goal = INT4_GOAL if fmt in INT4_FORMATS else MOE_GOAL if family.moe else None
            name = f"{family.name} {fmt}: decode packed / dequantized at load"
            ratio = decode_ratio(results, family.name, form)
            checks.append(
                Check(name, ratio, goal, "<=") if goal else Check(f"{name} (reported)", ratio, 0.0, ">=")
            )
        top_k = results[family.name]["config"]["num_experts_per_tok"] if family.moe else None
        for form, row in forms.items():
            record = row.get("decode_dequantization")
            if record and record["expert_weights"]:
                routed = record["experts"] / record["expert_weights"]
                name = f"{family.name} {form}: experts dequantized per expert weight per decode token"
                checks.append(Check(name, routed, top_k, "<=", unit="experts"))
    return checks


def packed_speed(ctx: Context) -> Result:
    results, notes = {}, []
    for family in FAMILIES:
        started, load = time.perf_counter(), os.getloadavg()[0]
        results[family.name] = measure_family(family, ctx)
        notes += family_table(family, results[family.name])
        notes.append(
            f"  ({time.perf_counter() - started:.0f} s to write, load and time; load average {load:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores)"
        )
    notes += [f"{name}: skipped: {reason}" for name, reason in SKIPPED.items()]
    checks = checks_of(results)
    return Result(
        item="q",
        title="Packed quantized weights: one block packed vs dequantized at load vs transformers (bf16)",
        ratio=decode_ratio(results, "moe", "fp8 packed"),
        baseline="the same Qwen3-MoE block, FP8 checkpoint dequantized at load, decode",
        checks=checks,
        measurements=results,
        settings={"dtype": "bfloat16", "threads": torch.get_num_threads(), "skipped": SKIPPED},
        notes=notes,
    )


BENCHMARKS = {"packed_speed": packed_speed}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
