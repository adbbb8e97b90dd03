from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeTextRotaryEmbedding,
)
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


class Qwen3_5Block(RotaryBlockMixin, Qwen3_5DecoderLayer):
    """One Qwen3.5 layer: a gated delta net or gated full attention (partial rotary), as ``layer_types``
    says for its index, then a dense MLP. Its rotary is multimodal (``mrope_section``), but text
    positions are the same on all three axes, which is what a block's 2-D positions expand to."""

    rotary_class = Qwen3_5TextRotaryEmbedding


class Qwen3_5MoeBlock(RotaryBlockMixin, Qwen3_5MoeDecoderLayer):
    """One Qwen3.5 MoE layer: Qwen3.5's token mixer of its index, then routed experts and a gated
    shared expert."""

    rotary_class = Qwen3_5MoeTextRotaryEmbedding


class Qwen2MoeBlock(RotaryBlockMixin, Qwen2MoeDecoderLayer):
    """One Qwen2 MoE layer: attention with q/k/v biases, then routed experts and a gated shared expert."""

    rotary_class = Qwen2MoeRotaryEmbedding
