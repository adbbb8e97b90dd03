from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from petals.block import RotaryBlockMixin


class LlamaBlock(RotaryBlockMixin, LlamaDecoderLayer):
    """One Llama decoder layer with its rotary embedding (llama3 rope scaling included)."""

    rotary_class = LlamaRotaryEmbedding
