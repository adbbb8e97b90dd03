from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer, GptOssRotaryEmbedding

from petals.block import RotaryBlockMixin


class GptOssBlock(RotaryBlockMixin, GptOssDecoderLayer):
    """One GPT-OSS layer: attention with a learned sink per head (sliding on the layers ``layer_types``
    says), then routed experts."""

    rotary_class = GptOssRotaryEmbedding
