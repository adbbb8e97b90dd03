"""Quantized checkpoints in their published layouts, written from a dense checkpoint's tensors.

Benchmarks need blocks of realistic sizes in each format petals serves packed; the writers in the tests
quantize tiny models a block or a group at a time, which is too slow at these sizes. These quantize
whole tensors at once, the same way:

- FP8 as DeepSeek V3 and Qwen3 FP8 publish it: every linear weight of the decoder layers (the MoE router
  excepted) as ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128x128 block (edge blocks
  cropped), each block's largest magnitude mapped to 448;
- MXFP4 as GPT-OSS publishes it: the experts' ``gate_up_proj``/``down_proj`` as ``*_blocks`` (two FP4
  e2m1 codes a byte, low nibble first, 32 a group along the input) and ``*_scales`` (e8m0);
- GPTQ int4 as AutoGPTQ writes it (``checkpoint_format: gptq``, symmetric, groups of 128, no act
  order): ``qweight`` packed along the input, ``qzeros`` (stored minus one) along the output, float16
  ``scales``, ``g_idx``; every ``*proj.weight`` of the decoder layers;
- a Llama as a GGUF file in Q4_K, as llama.cpp's converter lays it out (``llama.*`` metadata, GGUF
  names, query and key rows permuted), every layer matrix Q4_K (a "pure" Q4_K build), norms F32.
  ``gguf`` cannot write K-quants: the Q4_K blocks are ``tests/gguf_kquants.py``'s round-to-nearest
  encoding, mirrored here (benchmarks do not import the tests).

Values are whatever the dense checkpoint holds (random weights time like real ones).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP8_BLOCK = (128, 128)
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GPTQ_GROUP = 128


def write_quantized(dense: Path, folder: Path, quantize) -> Path:
    """``quantize(tensors) -> (stored tensors, quantization_config)`` applied to the dense checkpoint
    ``dense`` (one ``model.safetensors``), written to ``folder`` with the dense config plus its
    ``quantization_config``; the checkpoint's path."""
    stored, quantization_config = quantize(load_file(dense / "model.safetensors"))
    folder.mkdir(parents=True)
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _is_layer_linear(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's linear weight, the MoE router (``mlp.gate``) excepted, as the releases leave it."""
    return name.startswith("model.layers.") and tensor.ndim == 2 and not name.endswith("mlp.gate.weight")


# --- FP8, 128x128 blocks -----------------------------------------------------------------------------


def fp8_blockwise(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    stored = {}
    for name, tensor in tensors.items():
        if _is_layer_linear(name, tensor):
            stored[name], stored[f"{name}_scale_inv"] = quantize_fp8(tensor)
        else:
            stored[name] = tensor
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
    }
    return stored, config


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 codes, float32 scale per block)``: the weight padded to whole blocks, scaled, cropped."""
    rows, cols = weight.shape
    (b0, b1), grid = FP8_BLOCK, (math.ceil(rows / FP8_BLOCK[0]), math.ceil(cols / FP8_BLOCK[1]))
    padded = torch.nn.functional.pad(weight.float(), (0, grid[1] * b1 - cols, 0, grid[0] * b0 - rows))
    blocks = padded.view(grid[0], b0, grid[1], b1)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    codes = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes.view(grid[0] * b0, grid[1] * b1)[:rows, :cols].contiguous(), scale_inv


# --- MXFP4, GPT-OSS experts --------------------------------------------------------------------------


def mxfp4_experts(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    stored = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = quantize_mxfp4(tensor)
        else:
            stored[name] = tensor
    config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return stored, config


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' experts ``[experts, in, out]`` → (uint8 blocks ``[experts, out, in / 32, 16]``,
    uint8 e8m0 scales ``[experts, out, in / 32]``): each group's largest magnitude within ``6 * 2**e``,
    every value the nearest FP4 one (ties to the smaller magnitude), one expert at a time."""
    blocks, scales = [], []
    midpoints = (FP4_MAGNITUDES[1:] + FP4_MAGNITUDES[:-1]) / 2
    for expert in weight:
        groups = expert.T.float().contiguous().view(expert.shape[1], -1, 32)  # [out, in / 32, 32]
        exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
        scaled = groups / torch.exp2(exponent)[..., None]
        codes = torch.bucketize(scaled.abs(), midpoints) | (scaled < 0).long() << 3
        blocks.append((codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8))
        scales.append((exponent + 127).to(torch.uint8))
    return torch.stack(blocks), torch.stack(scales)


# --- GPTQ int4 ---------------------------------------------------------------------------------------


def gptq_int4(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    stored = {}
    for name, tensor in tensors.items():
        if _is_layer_linear(name, tensor) and name.endswith("proj.weight"):
            prefix = name.removesuffix("weight")
            qweight, qzeros, scales = quantize_gptq(tensor)
            stored.update(
                {
                    prefix + "qweight": qweight,
                    prefix + "qzeros": qzeros,
                    prefix + "scales": scales,
                    prefix + "g_idx": (torch.arange(tensor.shape[1]) // GPTQ_GROUP).to(torch.int32),
                }
            )
        else:
            stored[name] = tensor
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GPTQ_GROUP,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    return stored, config


def quantize_gptq(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` → (qweight ``[in / 8, out]``, qzeros ``[in / 128, out / 8]``, float16 scales
    ``[in / 128, out]``): symmetric, ``w ≈ scale * (q - 8)``."""
    w = weight.T.float().contiguous()  # [in, out]
    groups = w.reshape(-1, GPTQ_GROUP, w.shape[1])
    scales = (groups.abs().amax(dim=1).clamp(min=1e-8) * 2 / 15).to(torch.float16)
    q = torch.clamp(torch.round(groups / scales.float()[:, None, :]) + 8, 0, 15).long().reshape(w.shape)
    zeros = torch.full(scales.shape, 8 - 1, dtype=torch.long)  # v1 stores each zero minus one
    return _pack_nibbles(q), _pack_nibbles(zeros.T).T.contiguous(), scales


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit values a word along dim 0 (the first in the lowest bits) → int32 with those bits."""
    runs = values.reshape(-1, 8, values.shape[1])
    words = sum(runs[:, j, :] << (4 * j) for j in range(8))
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


# --- GGUF Q4_K, a Llama -------------------------------------------------------------------------------

GGUF_LAYER_NAMES = {  # GGUF name -> Hugging Face name, in a Llama decoder layer
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def write_gguf_llama(dense: Path, folder: Path) -> Path:
    """The dense Llama checkpoint ``dense`` as one GGUF file in ``folder``, layer matrices in Q4_K; the
    file's path."""
    import gguf

    folder.mkdir(parents=True)
    path = folder / "model.Q4_K.gguf"
    config = json.loads((dense / "config.json").read_text())
    state = {name: tensor.float().numpy() for name, tensor in load_file(dense / "model.safetensors").items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].astype(np.float16))
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for index in range(config["num_hidden_layers"]):
        for short, hf_name in GGUF_LAYER_NAMES.items():
            weight = state[f"model.layers.{index}.{hf_name}.weight"]
            if weight.ndim == 1:  # a norm
                writer.add_tensor(f"blk.{index}.{short}.weight", weight)
                continue
            if short in heads:
                weight = _permute_rows(weight, heads[short])
            writer.add_tensor(
                f"blk.{index}.{short}.weight", quantize_q4_k(weight), raw_dtype=gguf.GGMLQuantizationType.Q4_K
            )
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of query/key rows (each head's rotary halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` (``cols`` a multiple of 256) → uint8 Q4_K blocks ``[rows, cols / 256 * 144]``: per
    256 values float16 ``d`` and ``dmin``, eight 6-bit sub-block scales and mins in 12 bytes, 128 bytes of
    nibbles; each of the eight sub-blocks of 32 is ``x ~ d * sc * q - dmin * m``, rounded to nearest."""
    sub_blocks = weight.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(sub_blocks.min(axis=-1), 0)
    scales = (sub_blocks.max(axis=-1) - low) / 15
    d, dmin = (scales.max(axis=-1) / 63).astype(np.float16), (-low.min(axis=-1) / 63).astype(np.float16)
    sc, m = _ratio(scales, d, 63), _ratio(-low, dmin, 63)
    step, offset = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * m
    q = _ratio(sub_blocks + offset[..., None], step[..., None], 15)
    packed = np.empty(
        (len(sc), 12), dtype=np.uint8
    )  # scales 0-3 and mins 0-3 (top bits: 4-7's), then 4-7's low
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    runs = q.reshape(len(q), 4, 2, 32)  # of each 64 values, the first 32 in low nibbles, the next in high
    nibbles = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(len(q), 128)
    halves = [value.reshape(-1, 1).view(np.uint8) for value in (d, dmin)]
    return np.concatenate([*halves, packed, nibbles], axis=1).reshape(weight.shape[0], -1)


def _ratio(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """``round(values / unit)`` clipped to 0..top, 0 where ``unit`` is 0."""
    unit = np.broadcast_to(
        unit.astype(np.float32).reshape(unit.shape + (1,) * (values.ndim - unit.ndim)), values.shape
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(unit > 0, np.rint(values / unit), 0)
    return np.clip(ratio, 0, top).astype(np.uint8)
