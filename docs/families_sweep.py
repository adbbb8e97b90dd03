"""Run the conformance kit with the generic plugin (``petals.testing.generic``: the three-line form made
from transformers' own modeling code) on every text-only causal-LM model type transformers ships, and
record each in docs/families_sweep.json as served exactly, refused (one line) or broken (one line).

    python docs/families_sweep.py                # the types not yet in the JSON, one subprocess each
    python docs/families_sweep.py --redo         # every type again
    python docs/families_sweep.py --redo a b     # types a and b again
    python docs/families_sweep.py --one a        # type a in this process; print its entry

Statuses: ``exact`` (the kit passes: every logit within its tolerance, fp32), ``refused`` (a one-line
refusal before anything is computed: core's, such as a layer kind it cannot cache, or the generic
plugin's, where transformers' layer is not called the three-line way), ``broken`` (the kit runs and the
logits differ, or core crashes), ``untested`` (transformers' own model does not run on the tiny config,
or the kit ran past the time limit: a fault of this sweep, not a verdict). Types a first-party plugin
serves are swept too: the report says whether the generic path alone would serve them.

Not swept, and why (``NOT_TEXT_DECODERS``, and what ``docs/families.py`` already tells apart): encoder
families (their causal head is for encoder-decoder use), decoders of encoder-decoder models, decoders
attending to another model's states (cross-attention), and multimodal wrappers (served as their text
model, which is swept under its own type).
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "families_sweep.json"
TIMEOUT_S = 120
# causal-LM types that are no text-only decoder, beyond what their configs say (is_encoder_decoder, a
# masked-LM head, a text_config of another type)
NOT_TEXT_DECODERS = {
    "bert-generation": "an encoder used as the decoder of an encoder-decoder model (cross-attention)",
    "trocr": "the decoder of an image-to-text encoder-decoder model (cross-attention)",
}
# where shrinking by field names breaks a type's tiny config: the fields to set, and why
ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1)
OVERRIDES: dict[str, dict[str, Any]] = {
    # defaults that transformers' own model cannot build: a None it computes with
    "hunyuan_v1_dense": dict(head_dim=16),
    "hunyuan_v1_moe": dict(head_dim=16),
    "ministral": dict(head_dim=16),
    "nemotron": dict(num_key_value_heads=2),
    "dots1": ROUTED,
    "deepseek_v2": dict(ROUTED, topk_method="group_limited_greedy"),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1),
    "cohere_compass_text": dict(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    ),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),  # its default fails its own validation
    # its attention config's defaults leave rope_theta and clip_qkv unset, which its model reads
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),
    # the default pattern has no attention layer in four (its layers are placed by period or index)
    "bamba": dict(attn_layer_indices=[1, 3]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),
    "gemma3n_text": dict(
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.0] * 4,
    ),
}


ABSOLUTE_POSITIONS = "absolute position embeddings, added by the model before its layers: the kit runs transformers' model as a client does, its layer list remote, so the model has no cache to count positions from and embeds every step from position 0; the forward without a cache and the prefill are exact, the first single step is not"
BUILT_FOR_WIDTHS = "core's default cache_spec builds attn_class(config, layer_idx) to read its key and value widths; this attention class is built from other arguments (TypeError in kv_cache/specs.py), before any block runs"
CONVERTED_WITHOUT_MODEL = "core's convert_checkpoint_names (loading.py) runs transformers' weight converters of this type without a model, and one of them reads model.get_parameter: AttributeError on None"
NON_PERSISTENT = "a non-persistent buffer of the layer ({name}) is in no checkpoint: load_block builds the block on the meta device and fills it from the checkpoint only, so the buffer stays on meta"
# what a look at each broken type found: the feature that breaks, and where (measured on the sweep's
# tiny configs; ``docs/families.md`` shows them beside the kit's one line)
FINDINGS: dict[str, str] = {
    "gpt2": ABSOLUTE_POSITIONS,
    "gpt-sw3": ABSOLUTE_POSITIONS,
    "opt": ABSOLUTE_POSITIONS,
    "biogpt": BUILT_FOR_WIDTHS,
    "xglm": BUILT_FOR_WIDTHS,
    "laguna": BUILT_FOR_WIDTHS,
    "param2moe": CONVERTED_WITHOUT_MODEL,
    "sarvam_moe": CONVERTED_WITHOUT_MODEL,
    "lara_mini": CONVERTED_WITHOUT_MODEL,
    "gemma3n_text": NON_PERSISTENT.format(name="altup.router_input_scale"),
    "falcon_mamba": NON_PERSISTENT.format(name="the weightless norms' weight, a ones vector"),
    "dbrx": (
        "its config's num_key_value_heads (1) is not its attention's kv_n_heads (attn_config: 2 here), and the "
        "attention projects queries, keys and values with one fused Wqkv: core's default reads the former and "
        "finds no k_proj to read the width from, so its spec has one key/value head where the layer has two"
    ),
    "mimo_v2_flash": (
        "attention sinks on sliding layers with twice the config's key/value heads (num_key_value_heads * 2): "
        "core reads k_proj's width (4 heads of 16) and divides it by the config's 2 heads, so its spec says 32 "
        "values a head where the layer caches 16"
    ),
    "git": (
        "core builds attn_class with a config whose _attn_implementation is unset, and GitAttention picks its "
        "self-attention class by it (KeyError None)"
    ),
    "doge": (
        "a dynamic mask added onto the causal mask: Doge's model always materializes the mask "
        "(allow_is_causal_skip=False), core's block hands None where sdpa's is_causal would do, so the layer "
        "attends to later tokens: the forward without a cache differs by 0.73"
    ),
    "lfm3": (
        "RotaryBlockMixin computes the rotary embedding for every layer, with its layer type; this rotary "
        "module keeps parameters per attention type only, and has none for the conv layers (KeyError 'conv')"
    ),
    "ergo": (
        "its model zips its layer types with its layer list strictly (zip(..., strict=True)): the one module "
        "the kit and the client put in the layer list in place of all layers (the remote chain) is shorter"
    ),
    "gemma4_text": (
        "per-layer inputs: transformers' model hands each layer its per_layer_input (from the token ids), which "
        "the block does not (None * tensor); petals-gemma refuses hidden_size_per_layer_input > 0 in one line"
    ),
    "gemma4_unified_text": (
        "only the batching check, by float rounding: a session merged with others differs from its solo run "
        "by 1.2e-05 against the kit's 1e-05; every logit check passes"
    ),
}


def causal_lm_types() -> dict[str, str | None]:
    """Every model type of transformers' causal-LM mapping -> why it is no text-only decoder (None: it is)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        model_type: not_text_decoder(model_type) for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    }


def not_text_decoder(model_type: str) -> str | None:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if model_type in NOT_TEXT_DECODERS:
        return NOT_TEXT_DECODERS[model_type]
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder family (its causal head is for encoder-decoder use)"
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:  # its defaults fail its own checks: swept, and the tiny config may pass them
        return None
    if getattr(config, "is_encoder_decoder", False):
        return "the decoder of an encoder-decoder model"
    text_type = getattr(getattr(config, "text_config", None), "model_type", None)
    if text_type is not None and text_type != model_type:
        return f"a multimodal wrapper of a {text_type} text model (swept as {text_type})"
    return None


def sweep_one(model_type: str, workdir: str | Path) -> dict[str, Any]:
    """Run the kit on ``model_type`` with the generic plugin; its entry (without ``seconds``)."""
    from petals.kv_cache import UnservedCacheKindError
    from petals.plugins import PluginError
    from petals.testing.conformance import check_family
    from petals.testing.generic import UnfitLayerError, generic_family, serving_generic, tiny_config

    try:
        config = tiny_config(model_type, OVERRIDES.get(model_type))
        family = generic_family(model_type, config)
    except UnfitLayerError as error:
        return _entry("refused", f"generic plugin: {_one_line(error)}", group=_unfit_group(str(error)))
    except Exception as error:
        return _entry("untested", f"transformers cannot build the tiny config's model: {_one_line(error)}")
    found = _found(config, family)
    try:
        _run_transformers_model(config)
    except Exception as error:
        return _entry(
            "untested", f"transformers' own model fails on the tiny config: {_one_line(error)}", found
        )
    try:
        with serving_generic(config, family):
            report = check_family(config, workdir)
    except (UnservedCacheKindError, PluginError) as error:
        reason = re.split(r";|\(|: petals-core|: serve", _one_line(error).split(": ", 1)[1])[0].strip()
        return _entry("refused", reason, found, group=_unserved_group(str(error)))
    except AssertionError as error:
        return _entry("broken", _one_line(error, with_type=False), found)
    except Exception as error:
        return _entry("broken", f"{_one_line(error)} (at {_where(error)})", found)
    diff = max(report.max_abs_diff.values())
    kinds = list(dict.fromkeys(spec.describe() for spec in report.cache_specs))
    return _entry("exact", "", found, max_abs_diff=diff, cache_kinds=kinds)


def _run_transformers_model(config) -> None:
    """transformers' own model of ``config``: a prompt, then a step on its cache (what the kit compares with)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 8)[None], cache=cache, use_cache=True)
        model(input_ids=torch.tensor([[4]]), cache=cache, use_cache=True)


def _found(config, family: type) -> dict[str, Any]:
    """What the generic plugin read from transformers' model: the block's layer classes, rotary, attention."""
    blocks = [family.block_class, *family.block_classes.values()]
    return {
        "layers": config.num_hidden_layers,
        "layer_classes": [block.__bases__[-1].__name__ for block in blocks],
        "rotary": family.block_class.rotary_class.__name__ if family.block_class.rotary_class else None,
        "attn_class": family.attn_class.__name__ if family.attn_class else None,
        "block_prefix": family.block_prefix,
    }


def _entry(status: str, reason: str, found: dict | None = None, **more) -> dict[str, Any]:
    return {"status": status, "reason": reason, **(found or {}), **more}


def _unfit_group(message: str) -> str:
    if "takes its cache as" in message or "not hidden_states" in message:
        return (
            "its layer is called otherwise than the three-line block calls it (a plugin writes its forward)"
        )
    if "is built with" in message:
        return "its layer is built with more than its config and index (a plugin writes its block)"
    if "hands its layers" in message:
        return "its model hands each layer more than masks, positions and rotary embeddings"
    return "transformers builds its layers otherwise than as one list of decoder layers"


def _unserved_group(message: str) -> str:
    kind = re.search(r"is an? (.+?) layer", message)
    kind = kind.group(1) if kind else "?"
    if "sizes core cannot read" in message:
        return f"{kind} layers: sizes only a plugin's cache_spec can give"
    return f"{kind} layers: a kind core cannot cache"


def _one_line(error: BaseException, with_type: bool = True) -> str:
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    line = f"{type(error).__name__}: {line}" if with_type else line
    return line if len(line) <= 240 else line[:239] + "…"


def _where(error: BaseException) -> str:
    """The innermost frame of petals-core, else the innermost one."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if "/petals/" in frame.filename] or frames
    frame = ours[-1]
    return f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno}"


def run_one(model_type: str) -> dict[str, Any]:
    """``sweep_one`` in a subprocess with a time limit, with its seconds."""
    start = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, __file__, "--one", model_type],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        entry = _entry("untested", f"the kit ran past {TIMEOUT_S} s")
    else:
        last = result.stdout.strip().splitlines()[-1:] or [""]
        try:
            entry = json.loads(last[0])
        except json.JSONDecodeError:
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            entry = _entry("broken", f"the process died (exit {result.returncode}): {tail[:200]}")
    entry["seconds"] = round(time.monotonic() - start, 1)
    return entry


def with_findings(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with each broken type's ``finding`` (``FINDINGS``), and none on the others."""
    for model_type, entry in results.get("types", {}).items():
        entry.pop("finding", None)
        if entry["status"] == "broken" and model_type in FINDINGS:
            entry["finding"] = FINDINGS[model_type]
    return results


def load_results() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"types": {}}


def save_results(results: dict[str, Any]) -> None:
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        import torch

        torch.set_num_threads(1)
        warnings.filterwarnings("ignore")
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        with tempfile.TemporaryDirectory() as workdir:
            print(json.dumps(sweep_one(argv[1], workdir)))
        return 0
    import torch
    import transformers

    results = load_results()
    redo = argv[1:] if argv[:1] == ["--redo"] else []
    if results.get("transformers") not in (None, transformers.__version__) and argv != ["--redo"]:
        print(
            f"{RESULTS.name} was swept with transformers {results['transformers']}, this is "
            f"{transformers.__version__}: run with --redo (every type)",
            file=sys.stderr,
        )
        return 1
    if argv == ["--redo"]:
        results["types"] = {}
    types = causal_lm_types()
    results.update(transformers=transformers.__version__, torch=torch.__version__.split("+")[0])
    results.update(timeout_s=TIMEOUT_S, date=datetime.date.today().isoformat())
    results["not_text_decoders"] = {model_type: why for model_type, why in types.items() if why}
    swept = results.setdefault("types", {})
    save_results(with_findings(results))
    for model_type in [model_type for model_type, why in types.items() if why is None]:
        if model_type in swept and model_type not in redo:
            continue
        swept[model_type] = run_one(model_type)
        results["types"] = dict(sorted(swept.items()))
        save_results(with_findings(results))
        entry = swept[model_type]
        print(f"{model_type}: {entry['status']} {entry['reason']} ({entry['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
