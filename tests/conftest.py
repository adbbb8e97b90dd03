"""Shared fixtures: tiny random models of every family, saved in the Hugging Face layout."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig, LlamaConfig, MixtralConfig

TINY_CONFIGS = {
    "llama": LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "bloom": BloomConfig(hidden_size=64, n_layer=4, n_head=4, vocab_size=1000),
    "falcon-new": FalconConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        vocab_size=1000,
        new_decoder_architecture=True,
        parallel_attn=True,
        alibi=False,
        bias=False,
    ),
    "falcon-multi-query": FalconConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=1000,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
        alibi=False,
        bias=False,
    ),
    "falcon-rw": FalconConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=1000,
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=False,
        alibi=True,
        bias=True,
    ),
    "mixtral": MixtralConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
    ),
}


def tiny_config(variant: str):
    return copy.deepcopy(TINY_CONFIGS[variant])


def save_tiny_model(variant: str, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(variant), dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """``tiny_model_path("llama")`` → a directory with a tiny random model of that variant."""
    cache: dict[str, Path] = {}

    def build(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = save_tiny_model(variant, tmp_path_factory.mktemp(variant) / f"tiny-{variant}")
        return cache[variant]

    return build


def install_in_hf_cache(source: Path, repo_id: str, cache_dir: Path, revision: str = "0" * 40) -> Path:
    """Lay out ``source``'s files as the Hugging Face hub cache does for ``repo_id`` (no network)."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    return snapshot


@pytest.fixture
def offline_hf_cache(tmp_path, monkeypatch):
    """An empty HF hub cache, used offline by every process this test starts."""
    cache_dir = tmp_path / "hf-cache"
    cache_dir.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache_dir


# ---- a real local swarm for client tests: see petals.testing.swarm ----------------------------
from petals.testing.swarm import LOOPBACK_CLIENT, running_swarm  # noqa: E402, F401
