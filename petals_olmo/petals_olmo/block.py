from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer, Olmo2RotaryEmbedding
from transformers.models.olmo3.modeling_olmo3 import Olmo3DecoderLayer, Olmo3RotaryEmbedding
from transformers.models.olmoe.modeling_olmoe import OlmoeDecoderLayer, OlmoeRotaryEmbedding

from petals.block import RotaryBlockMixin


class Olmo2Block(RotaryBlockMixin, Olmo2DecoderLayer):
    """One OLMo 2 layer: attention with q/k norms over all heads, norms after attention and
    after the MLP (none before)."""

    rotary_class = Olmo2RotaryEmbedding


class Olmo3Block(RotaryBlockMixin, Olmo3DecoderLayer):
    """One OLMo 3 layer: OLMo 2's, sliding on the layers ``layer_types`` says."""

    rotary_class = Olmo3RotaryEmbedding


class OlmoeBlock(RotaryBlockMixin, OlmoeDecoderLayer):
    """One OLMoE layer: attention with q/k norms, then routed experts."""

    rotary_class = OlmoeRotaryEmbedding
