"""GGUF files served as published: each server reads only its blocks' tensors from the file.

The fixtures write tiny random Llamas in llama.cpp's real layout with ``gguf.GGUFWriter``: the
``llama.*`` metadata keys, tensors under GGUF names (``blk.N.attn_q.weight`` ...), query and key rows
permuted as llama.cpp's converter permutes them, norms in F32. One file stores attention weights and
the head in Q8_0, the MLP and embeddings in F16; another is laid out as a Q4_K_M build (Q4_K matrices,
Q6_K for the value and down projections and the head, Q8_0 embeddings; written by ``gguf_kquants``,
since gguf cannot quantize K-quants). A third is a tiny Qwen3-MoE, its experts stacked in 3-D tensors
(``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``) as llama.cpp stores them. The reference is
transformers loading the same file, dequantized.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import petals
from conftest import LOOPBACK_CLIENT, petals_health
from petals.auto import AutoDistributedConfig
from petals.block import make_block
from petals.convert import block_weight_bytes
from petals.formats import stored_as, weights_note
from petals.formats.gguf import GGUFCheckpoint, GgufInt4Weight, GgufWeight, gguf_file, reader, release_readers
from petals.formats.packed import packed_weights
from petals.loading import CheckpointError, load_block, open_checkpoint
from petals.local_swarm import running_swarm

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install gguf")
import gguf_kquants  # noqa: E402

CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
K_CONFIG = LlamaConfig(  # rows of whole 256-value K-quant super-blocks
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
ROPE_THETA = 10000.0  # transformers' LlamaConfig default
Q8_0, F16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
LAYER_TENSORS = {  # GGUF name -> (Hugging Face name, stored as)
    "attn_q": ("self_attn.q_proj", Q8_0),
    "attn_k": ("self_attn.k_proj", Q8_0),
    "attn_v": ("self_attn.v_proj", Q8_0),
    "attn_output": ("self_attn.o_proj", Q8_0),
    "ffn_gate": ("mlp.gate_proj", F16),
    "ffn_up": ("mlp.up_proj", F16),
    "ffn_down": ("mlp.down_proj", F16),
    "attn_norm": ("input_layernorm", None),
    "ffn_norm": ("post_attention_layernorm", None),
}
Q4_K_M_TYPES = {  # as llama.cpp's Q4_K_M: Q6_K where precision matters most
    "attn_q": Q4_K,
    "attn_k": Q4_K,
    "attn_v": Q6_K,
    "attn_output": Q4_K,
    "ffn_gate": Q4_K,
    "ffn_up": Q4_K,
    "ffn_down": Q6_K,
}


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of query/key rows (interleaved rotary halves)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def add_tensor(writer, name: str, weight: np.ndarray, stored_as) -> None:
    """``weight`` under ``name`` as ``stored_as`` (None: F32) stores it."""
    if stored_as is None:
        writer.add_tensor(name, weight.astype(np.float32))
    elif stored_as == F16:
        writer.add_tensor(name, weight.astype(np.float16))
    elif stored_as in gguf_kquants.QUANTIZERS:
        writer.add_tensor(name, gguf_kquants.quantize(weight, stored_as), raw_dtype=stored_as)
    else:
        writer.add_tensor(name, gguf.quants.quantize(weight, stored_as), raw_dtype=stored_as)


def write_tiny_llama_gguf(
    path: Path,
    seed: int = 0,
    config: LlamaConfig = CONFIG,
    types: dict | None = None,
    embeddings=F16,
    head=Q8_0,
) -> Path:
    """A random Llama of ``config`` as llama.cpp writes one; ``types``: the GGUF type of each layer
    matrix by short name (default: ``LAYER_TENSORS``'), ``embeddings`` and ``head`` those two's."""
    types = {short: stored for short, (_, stored) in LAYER_TENSORS.items()} | (types or {})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)

    add_tensor(writer, "token_embd.weight", state["model.embed_tokens.weight"], embeddings)
    for index in range(config.num_hidden_layers):
        for short, (hf_name, _) in LAYER_TENSORS.items():
            weight = state[f"model.layers.{index}.{hf_name}.weight"]
            if short == "attn_q":
                weight = permute_rows(weight, config.num_attention_heads)
            elif short == "attn_k":
                weight = permute_rows(weight, config.num_key_value_heads)
            add_tensor(writer, f"blk.{index}.{short}.weight", weight, types[short])
    add_tensor(writer, "output_norm.weight", state["model.norm.weight"], None)
    add_tensor(writer, "output.weight", state["lm_head.weight"], head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MOE_CONFIG = Qwen3MoeConfig(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=768,  # transformers reads no expert width from a GGUF file: its default
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,  # what transformers sets for a qwen3moe GGUF file, as llama.cpp computes
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
Q4_1 = gguf.GGMLQuantizationType.Q4_1
MOE_LAYER_TENSORS = {  # GGUF name -> (Hugging Face name, rows taken from it, stored as)
    "attn_q": ("self_attn.q_proj.weight", None, Q8_0),
    "attn_k": ("self_attn.k_proj.weight", None, Q8_0),
    "attn_v": ("self_attn.v_proj.weight", None, Q8_0),
    "attn_output": ("self_attn.o_proj.weight", None, Q8_0),
    "attn_q_norm": ("self_attn.q_norm.weight", None, None),
    "attn_k_norm": ("self_attn.k_norm.weight", None, None),
    "ffn_gate_inp": ("mlp.gate.weight", None, None),
    "ffn_gate_exps": ("mlp.experts.gate_up_proj", "first half", Q4_1),
    "ffn_up_exps": ("mlp.experts.gate_up_proj", "second half", Q4_1),
    "ffn_down_exps": ("mlp.experts.down_proj", None, Q8_0),
    "attn_norm": ("input_layernorm.weight", None, None),
    "ffn_norm": ("post_attention_layernorm.weight", None, None),
}


def write_tiny_qwen3_moe_gguf(path: Path, seed: int = 0, config: Qwen3MoeConfig = MOE_CONFIG) -> Path:
    """A random Qwen3-MoE as llama.cpp writes one: each layer's experts stacked in three 3-D tensors
    (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``: transformers' ``gate_up_proj`` is the first
    two joined along the rows, gate first), the router as ``ffn_gate_inp``, ``qwen3moe.*`` keys."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("tiny-qwen3-moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    add_tensor(writer, "token_embd.weight", state["model.embed_tokens.weight"], F16)
    half = config.moe_intermediate_size
    for index in range(config.num_hidden_layers):
        for short, (hf_name, rows, kind) in MOE_LAYER_TENSORS.items():
            weight = state[f"model.layers.{index}.{hf_name}"]
            if rows is not None:
                weight = weight[:, :half] if rows == "first half" else weight[:, half:]
            add_tensor(writer, f"blk.{index}.{short}.weight", np.ascontiguousarray(weight), kind)
    add_tensor(writer, "output_norm.weight", state["model.norm.weight"], None)
    add_tensor(writer, "output.weight", state["lm_head.weight"], Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_K_M.gguf"
    return write_tiny_llama_gguf(path, config=K_CONFIG, types=Q4_K_M_TYPES, embeddings=Q8_0, head=Q6_K)


def transformers_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True),
    ).eval()


def test_a_file_or_a_folder_holding_one_names_the_gguf(tiny_gguf, tmp_path):
    assert gguf_file(tiny_gguf) == tiny_gguf
    assert gguf_file(tiny_gguf.parent) == tiny_gguf
    assert gguf_file(tmp_path) is None
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\): name the one to use"):
        open_checkpoint(tmp_path)


def test_served_block_equals_the_same_weights_dequantized_in_one_process(tiny_gguf):
    config = AutoDistributedConfig.from_pretrained(tiny_gguf)
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 4, 2)
    reference = transformers_model(tiny_gguf)
    hidden = torch.randn(2, 5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    for index in range(CONFIG.num_hidden_layers):
        block = load_block(tiny_gguf, index, torch.float32, config=config, weights="dequantized")
        packed = load_block(tiny_gguf, index, torch.float32, config=config)
        expected = make_block(config, index).eval()  # the same block, filled from transformers' model
        expected.load_state_dict(reference.model.layers[index].state_dict(), strict=True)
        assert block.state_dict().keys() == expected.state_dict().keys()
        assert (block(hidden) - expected(hidden)).abs().max().item() <= 1e-5
        assert (packed(hidden) - block(hidden)).abs().max().item() <= 1e-6


def test_the_unpermuted_weights_are_the_written_ones_within_q8_0_error(tiny_gguf):
    """Not only equal to transformers: the query rows are the model's own again (Q8_0: ~1/127 per block)."""
    torch.manual_seed(0)
    written = LlamaForCausalLM(CONFIG).model.layers[1].self_attn.q_proj.weight
    block = load_block(tiny_gguf, 1, torch.float32)
    error = (block.self_attn.q_proj.weight.dequantize() - written).abs().max() / written.abs().max()
    assert 0 < error < 0.01


def test_a_server_of_blocks_reads_only_their_tensors_in_the_serving_dtype(tiny_gguf, monkeypatch):
    read: list[str] = []
    real_read = GGUFCheckpoint.read
    monkeypatch.setattr(
        GGUFCheckpoint,
        "read",
        lambda self, keys, dtype=None, packed=False: (
            read.extend(keys) or real_read(self, keys, dtype, packed)
        ),
    )
    config = AutoDistributedConfig.from_pretrained(tiny_gguf)
    checkpoint = open_checkpoint(tiny_gguf)
    blocks = [
        load_block(tiny_gguf, i, torch.bfloat16, config=config, checkpoint=checkpoint, weights="dequantized")
        for i in (1, 2)
    ]

    assert {checkpoint.weight_map[name] for name in read} == {
        f"blk.{index}.{short}.weight" for index in (1, 2) for short in LAYER_TENSORS
    }
    assert {t.dtype for block in blocks for t in block.state_dict().values()} == {torch.bfloat16}


def test_the_log_and_health_name_a_gguf_file_by_its_quant_types(tiny_gguf):
    """A GGUF config has no quantization_config: the file itself says what it stores."""
    config = AutoDistributedConfig.from_pretrained(tiny_gguf)
    assert stored_as(tiny_gguf, config) == stored_as(tiny_gguf.parent, config) == "gguf Q8_0/F16"
    assert weights_note("gguf Q8_0/F16", "dequantized", torch.float32, "cpu", None).startswith(
        "gguf Q8_0/F16 checkpoint dequantized to float32 as its blocks load"
    )


@pytest.mark.slow
def test_greedy_tokens_through_two_servers_equal_transformers_loading_the_gguf(tiny_gguf):
    ids = torch.randint(3, CONFIG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = transformers_model(tiny_gguf).generate(ids, **kwargs)

    with running_swarm(tiny_gguf, "0:2", "2:4") as (dht, servers):  # the file itself, as a user names it
        for server in servers:
            assert "gguf Q8_0/F16 checkpoint served packed on cpu" in server.log
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            tiny_gguf, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
        health = petals_health(dht.initial_peers)
    assert health.stdout.count("none (gguf Q8_0/F16 packed)") == 2, health.stdout + health.stderr
    assert "huggingface.co" not in health.stdout and tiny_gguf.name not in health.stdout, health.stdout
    assert torch.equal(output.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4


def test_loaded_blocks_hold_nothing_of_the_file_once_its_reader_is_released(k_quant_gguf):
    """A server releases the parsed file once its blocks are loaded (``release_readers``): its blocks,
    packed (GGUF blocks, int4 repacked) or dequantized, are copies, so the file's memory map goes with
    the reader, and its parsed metadata; a later read parses the file anew."""
    parsed = reader(k_quant_gguf)
    mapped = weakref.ref(parsed.data)
    blocks = [
        load_block(k_quant_gguf, 1, dtype, weights=weights)
        for dtype in (torch.float32, torch.bfloat16)
        for weights in ("packed", "dequantized")
    ]
    release_readers()
    del parsed
    gc.collect()
    assert mapped() is None
    assert {type(weight) for weight in packed_weights(blocks[2]).values()} == {GgufInt4Weight, GgufWeight}
    assert reader(k_quant_gguf).data is not None


# --- a Q4_K_M build: K-quants, and torch's int4 kernel in bfloat16 ------------------------------------


def stored_block_bytes(path: Path, index: int) -> int:
    """What the file stores for block ``index``: its tensors' bytes."""
    return sum(
        int(tensor.n_bytes) for tensor in reader(path).tensors if tensor.name.startswith(f"blk.{index}.")
    )


def test_k_quant_blocks_served_packed_compute_what_the_dequantized_blocks_compute(k_quant_gguf):
    config = AutoDistributedConfig.from_pretrained(k_quant_gguf)
    assert stored_as(k_quant_gguf, config) == "gguf Q4_K/Q6_K/Q8_0"
    reference = transformers_model(k_quant_gguf)
    hidden = torch.randn(2, 5, K_CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    for index in range(K_CONFIG.num_hidden_layers):
        dense = load_block(k_quant_gguf, index, torch.float32, config=config, weights="dequantized")
        packed = load_block(k_quant_gguf, index, torch.float32, config=config)
        expected = make_block(config, index).eval()
        expected.load_state_dict(reference.model.layers[index].state_dict(), strict=True)
        assert {type(weight) for weight in packed_weights(packed).values()} == {GgufWeight}
        assert (dense(hidden) - expected(hidden)).abs().max().item() <= 1e-5
        assert (packed(hidden) - dense(hidden)).abs().max().item() <= 1e-6
        assert block_weight_bytes(packed) == stored_block_bytes(k_quant_gguf, index)


def test_in_bfloat16_the_q4_k_matrices_run_on_the_int4_kernel_in_their_stored_bytes(k_quant_gguf):
    """Q4_K matrices repacked for torch's CPU int4 kernel (Q6_K ones stay blocks): the block takes at
    most 1.10x the bytes the file stores for it, and computes within a bfloat16 rounding of its output
    what the same block dequantized at load computes (a misread code or scale would be off by the
    block's whole contribution to the residual stream, 0.3 here)."""
    config = AutoDistributedConfig.from_pretrained(k_quant_gguf)
    hidden = torch.randn(2, 5, K_CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    for index in range(K_CONFIG.num_hidden_layers):
        packed = load_block(k_quant_gguf, index, torch.bfloat16, config=config)
        dense = load_block(k_quant_gguf, index, torch.bfloat16, config=config, weights="dequantized")
        kinds = {name: type(weight) for name, weight in packed_weights(packed).items()}
        assert (
            kinds["self_attn.q_proj.weight"] is GgufInt4Weight and kinds["mlp.down_proj.weight"] is GgufWeight
        )
        assert block_weight_bytes(packed) <= 1.10 * stored_block_bytes(k_quant_gguf, index)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            output = packed(hidden)
        kernel_calls = [event.count for event in profile.key_averages() if "int4pack_mm" in event.key]
        assert kernel_calls == [5]  # q, k, o, gate, up
        expected = dense(hidden)
        assert (output.float() - expected.float()).abs().max() <= 0.01 * expected.float().abs().max()
        assert not torch.equal(output, expected)  # the kernel's own rounding: it did compute


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_of_a_k_quant_file_through_two_servers_equal_transformers(k_quant_gguf, dtype):
    """In float32 the servers hold the file's blocks and compute transformers' weights exactly; in
    bfloat16 their Q4_K matrices run on the int4 kernel. The prompt is one where transformers' top two
    logits stay 5% of the largest apart at every step (about a dozen bfloat16 steps), so equal tokens
    test the servers' weights rather than rounding luck."""
    ids = torch.randint(3, K_CONFIG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = transformers_model(k_quant_gguf).generate(ids, **kwargs)
    top_two = [logits.topk(2).values[0] for logits in expected.logits]
    assert min(float((top[0] - top[1]) / top.abs().max()) for top in top_two) > 0.05

    server_args = ("--torch_dtype", dtype)
    with running_swarm(k_quant_gguf, "0:2", "2:4", server_args=server_args) as (dht, servers):
        for server in servers:
            assert "gguf Q4_K/Q6_K/Q8_0 checkpoint served packed on cpu" in server.log
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            k_quant_gguf, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    scale = max(logits.abs().max().item() for logits in expected.logits)
    assert diff < (1e-4 if dtype == "float32" else 0.05 * scale)


# --- an MoE: experts stacked in 3-D tensors, gate and up joined into one --------------------------------


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    return write_tiny_qwen3_moe_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen3-moe.gguf")


def test_an_moe_block_has_all_of_its_experts_gate_and_up_both(moe_gguf):
    """``gate_up_proj`` is made of two GGUF tensors: a block reads both, gate rows first, as transformers
    does (a checkpoint that took one of them, or none, would serve half an MLP or refuse to load)."""
    checkpoint = open_checkpoint(moe_gguf)
    assert checkpoint.sources["model.layers.1.mlp.experts.gate_up_proj"] == (
        "blk.1.ffn_gate_exps.weight",
        "blk.1.ffn_up_exps.weight",
    )
    assert checkpoint.sources["model.layers.1.mlp.experts.down_proj"] == ("blk.1.ffn_down_exps.weight",)
    reference = transformers_model(moe_gguf).model.layers[1].mlp.experts
    block = load_block(moe_gguf, 1, torch.float32, weights="dequantized")
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(block.mlp.experts, name), getattr(reference, name)), name


def test_moe_experts_are_served_as_their_gguf_rows_and_compute_what_transformers_computes(moe_gguf):
    """Stacked experts and gate joined to up stay GGUF blocks (each expert's rows are contiguous: one
    routed expert dequantizes alone); the block packed computes within 1e-6 of the block dequantized at
    load, which computes what transformers' own load of the file computes."""
    config = AutoDistributedConfig.from_pretrained(moe_gguf)
    reference = transformers_model(moe_gguf)
    hidden = torch.randn(2, 5, MOE_CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    for index in range(MOE_CONFIG.num_hidden_layers):
        dense = load_block(moe_gguf, index, torch.float32, config=config, weights="dequantized")
        packed = load_block(moe_gguf, index, torch.float32, config=config)
        expected = make_block(config, index).eval()
        expected.load_state_dict(reference.model.layers[index].state_dict(), strict=True)
        weights = packed_weights(packed)
        assert {type(weight) for weight in weights.values()} == {GgufWeight}
        assert tuple(weights["mlp.experts.gate_up_proj"].shape) == (
            4,
            2 * MOE_CONFIG.moe_intermediate_size,
            64,
        )
        assert block_weight_bytes(packed) == stored_block_bytes(moe_gguf, index)  # norms, router: F32
        assert (dense(hidden)[0] - expected(hidden)[0]).abs().max().item() <= 1e-5
        assert (packed(hidden)[0] - dense(hidden)[0]).abs().max().item() <= 1e-6


@pytest.mark.slow
def test_greedy_tokens_of_an_moe_file_through_two_servers_equal_transformers(moe_gguf):
    ids = torch.randint(3, MOE_CONFIG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = transformers_model(moe_gguf).generate(ids, **kwargs)

    with running_swarm(moe_gguf, "0:2", "2:4") as (dht, servers):
        for server in servers:
            assert "gguf Q8_0/Q4_1/F16 checkpoint served packed on cpu" in server.log, server.log
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            moe_gguf, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4
