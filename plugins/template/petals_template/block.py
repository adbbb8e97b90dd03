from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralRotaryEmbedding

from petals.block import RotaryBlockMixin


class MistralBlock(RotaryBlockMixin, MistralDecoderLayer):
    """A rotary decoder layer needs no code of its own: the mixin calls it as transformers does.
    Layers with other calling conventions use ``petals.block.ServerBlockMixin`` and a ``forward``."""

    rotary_class = MistralRotaryEmbedding
