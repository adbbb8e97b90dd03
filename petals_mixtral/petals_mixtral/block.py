from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

from petals.block import RotaryBlockMixin


class MixtralBlock(RotaryBlockMixin, MixtralDecoderLayer):
    """One Mixtral layer: GQA attention (sliding window if configured) and the routed experts."""

    experts_implementation = "grouped_mm"  # what transformers picks for the full model
    rotary_class = MixtralRotaryEmbedding
