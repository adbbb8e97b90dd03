from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRotaryEmbedding

from petals.block import RotaryBlockMixin


class Qwen3Block(RotaryBlockMixin, Qwen3DecoderLayer):
    """One Qwen3 layer: GQA attention with per-head query and key norms (sliding on the layers
    ``layer_types`` says), then a dense MLP."""

    rotary_class = Qwen3RotaryEmbedding


class Qwen3MoeBlock(RotaryBlockMixin, Qwen3MoeDecoderLayer):
    """One Qwen3 MoE layer: Qwen3's attention, then routed experts (a dense MLP on ``mlp_only_layers``)."""

    rotary_class = Qwen3MoeRotaryEmbedding


class Qwen3NextBlock(RotaryBlockMixin, Qwen3NextDecoderLayer):
    """One Qwen3-Next layer: a gated delta net or gated full attention, as ``layer_types`` says for
    its index, then routed experts and a gated shared expert."""

    rotary_class = Qwen3NextRotaryEmbedding


class Qwen2MoeBlock(RotaryBlockMixin, Qwen2MoeDecoderLayer):
    """One Qwen2 MoE layer: attention with q/k/v biases, then routed experts and a gated shared expert."""

    rotary_class = Qwen2MoeRotaryEmbedding
