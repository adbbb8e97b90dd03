from transformers.models.glm4.modeling_glm4 import Glm4DecoderLayer, Glm4RotaryEmbedding
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRotaryEmbedding

from petals.block import RotaryBlockMixin


class Glm4Block(RotaryBlockMixin, Glm4DecoderLayer):
    """One GLM-4 layer: attention with q/k/v biases and partial rotary, a norm after attention
    and after the MLP as well as before them, then a fused gate/up MLP."""

    rotary_class = Glm4RotaryEmbedding


class Glm4MoeBlock(RotaryBlockMixin, Glm4MoeDecoderLayer):
    """One GLM-4.5/4.6 layer: attention (optionally with q/k norms), then a dense MLP (the first
    ``first_k_dense_replace`` layers) or shared and routed experts (group-limited routing)."""

    rotary_class = Glm4MoeRotaryEmbedding
