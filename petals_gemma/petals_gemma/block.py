from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding
from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer, Gemma2RotaryEmbedding
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding

from petals.block import RotaryBlockMixin


class GemmaBlock(RotaryBlockMixin, GemmaDecoderLayer):
    """One Gemma layer: multi-query or GQA attention, then a GeGLU MLP; norms scale by ``1 + weight``."""

    rotary_class = GemmaRotaryEmbedding


class Gemma2Block(RotaryBlockMixin, Gemma2DecoderLayer):
    """One Gemma 2 layer: attention with soft-capped scores (sliding on the layers ``layer_types`` says),
    norms before and after both attention and MLP."""

    rotary_class = Gemma2RotaryEmbedding


class Gemma3Block(RotaryBlockMixin, Gemma3DecoderLayer):
    """One Gemma 3 layer: Gemma 2's with query and key norms, and a rotary embedding per layer type
    (local sliding layers and global full ones differ in base)."""

    rotary_class = Gemma3RotaryEmbedding
