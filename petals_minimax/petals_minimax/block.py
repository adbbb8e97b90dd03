from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2DecoderLayer, MiniMaxM2RotaryEmbedding

from petals.block import RotaryBlockMixin


class MiniMaxM2Block(RotaryBlockMixin, MiniMaxM2DecoderLayer):
    """One MiniMax-M2 layer: attention with q/k norms over all heads at once and partial rotary
    (``rotary_dim``), then routed experts (sigmoid scores with a correction bias)."""

    rotary_class = MiniMaxM2RotaryEmbedding
