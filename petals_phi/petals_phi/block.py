from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding
from transformers.models.phimoe.modeling_phimoe import PhimoeDecoderLayer, PhimoeRotaryEmbedding

from petals.block import RotaryBlockMixin


class Phi3Block(RotaryBlockMixin, Phi3DecoderLayer):
    """One Phi-3 layer: fused qkv and gate/up projections, partial rotary (sliding where
    ``sliding_window`` says)."""

    rotary_class = Phi3RotaryEmbedding


class PhimoeBlock(RotaryBlockMixin, PhimoeDecoderLayer):
    """One Phi-3.5-MoE layer: attention with biases, then routed experts (sparsemixer routing)."""

    rotary_class = PhimoeRotaryEmbedding
