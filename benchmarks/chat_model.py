"""A tiny chat model for tests and quick benchmarks: a random 4-block Llama over the demo model's
vocabulary, saved with the demo model's tokenizer (``petals api`` needs a chat template)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_chat_llama(path: str | Path, *, seed: int = 0) -> Path:
    """Write the model and tokenizer to ``path`` (a folder in the Hugging Face layout) and return it; the
    same ``seed`` gives the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from petals.demo_model import prepare_demo_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_demo_model())
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    path = Path(path)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
