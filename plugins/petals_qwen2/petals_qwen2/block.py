from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from petals.block import RotaryBlockMixin


class Qwen2Block(RotaryBlockMixin, Qwen2DecoderLayer):
    """A Qwen2 layer: Llama-like with q/k/v biases; sliding-window attention on some layers
    (``layer_types``: each block is its own layer, with its own kind of cache)."""

    rotary_class = Qwen2RotaryEmbedding
