from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

from petals.block import RotaryBlockMixin


class MixtralBlock(RotaryBlockMixin, MixtralDecoderLayer):
    """One Mixtral layer: GQA attention (sliding window if configured) and the routed experts."""

    rotary_class = MixtralRotaryEmbedding
