"""The tiny Qwen2 configuration the plugin's tests build models from."""

from transformers import Qwen2Config


def tiny_qwen2(**overrides) -> Qwen2Config:
    settings = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
    )
    return Qwen2Config(**(settings | overrides))
