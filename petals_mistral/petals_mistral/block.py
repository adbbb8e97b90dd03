from transformers.models.ministral3.modeling_ministral3 import (
    Ministral3DecoderLayer,
    Ministral3RotaryEmbedding,
)
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralRotaryEmbedding

from petals.block import RotaryBlockMixin


class MistralBlock(RotaryBlockMixin, MistralDecoderLayer):
    """One Mistral layer: GQA attention (sliding on every layer when ``sliding_window`` is set), then a
    dense MLP."""

    rotary_class = MistralRotaryEmbedding


class Ministral3Block(RotaryBlockMixin, Ministral3DecoderLayer):
    """One Ministral 3 layer: Mistral's, with yarn rope and queries scaled by position
    (``llama_4_scaling_beta``) for long contexts."""

    rotary_class = Ministral3RotaryEmbedding
