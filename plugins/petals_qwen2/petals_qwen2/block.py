from transformers import PretrainedConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from petals.block import RotaryBlockMixin


class Qwen2Block(RotaryBlockMixin, Qwen2DecoderLayer):
    """A Qwen2 layer: Llama-like with q/k/v biases; sliding-window attention on some layers."""

    rotary_class = Qwen2RotaryEmbedding

    @classmethod
    def prepare_config(cls, config: PretrainedConfig, block_index: int) -> PretrainedConfig:
        # the block runs as layer 0 of its own cache, so it keeps only its own layer type
        config = super().prepare_config(config, block_index)
        config.layer_types = [config.layer_types[block_index]]
        return config
