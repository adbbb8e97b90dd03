from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.llama4.modeling_llama4 import Llama4TextDecoderLayer, Llama4TextRotaryEmbedding
from transformers.models.smollm3.modeling_smollm3 import SmolLM3DecoderLayer, SmolLM3RotaryEmbedding

from petals.block import RotaryBlockMixin


class LlamaBlock(RotaryBlockMixin, LlamaDecoderLayer):
    """One Llama decoder layer with its rotary embedding (llama3 rope scaling included)."""

    rotary_class = LlamaRotaryEmbedding


class Llama4TextBlock(RotaryBlockMixin, Llama4TextDecoderLayer):
    """One Llama 4 layer: chunked attention with rope and query norms, or full attention without rope
    (``no_rope_layers``), then routed experts with a shared one, or a dense MLP, by index."""

    rotary_class = Llama4TextRotaryEmbedding


class SmolLM3Block(RotaryBlockMixin, SmolLM3DecoderLayer):
    """One SmolLM3 layer: Llama's, without rope on the layers ``no_rope_layers`` marks 0."""

    rotary_class = SmolLM3RotaryEmbedding
