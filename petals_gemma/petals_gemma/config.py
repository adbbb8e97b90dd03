from transformers import Gemma2Config, Gemma3TextConfig, Gemma4TextConfig, GemmaConfig

from petals.config import DistributedConfigMixin, LazyClass
from petals_gemma.gemma4 import refuse_unservable


class DistributedGemmaConfig(DistributedConfigMixin, GemmaConfig):
    block_class = LazyClass("petals_gemma.block:GemmaBlock")
    attn_class = LazyClass("transformers.models.gemma.modeling_gemma:GemmaAttention")
    block_prefix = "model.layers"


class DistributedGemma2Config(DistributedConfigMixin, Gemma2Config):
    block_class = LazyClass("petals_gemma.block:Gemma2Block")
    attn_class = LazyClass("transformers.models.gemma2.modeling_gemma2:Gemma2Attention")
    block_prefix = "model.layers"


class DistributedGemma3TextConfig(DistributedConfigMixin, Gemma3TextConfig):
    block_class = LazyClass("petals_gemma.block:Gemma3Block")
    attn_class = LazyClass("transformers.models.gemma3.modeling_gemma3:Gemma3Attention")
    block_prefix = "model.layers"


class DistributedGemma4TextConfig(DistributedConfigMixin, Gemma4TextConfig):
    block_class = LazyClass("petals_gemma.block:Gemma4Block")
    attn_class = LazyClass("transformers.models.gemma4.modeling_gemma4:Gemma4TextAttention")
    block_prefix = "model.layers"

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        refuse_unservable(self)

    def adjust_client_model(self, model) -> None:
        # built without layers, transformers' model takes layer 0 for the first of those that share keys and
        # values, and would cut a prompt to its last token before the remote layers, which need every
        # position (servers cut nothing: a reusing layer's keys and values come from its source's pass)
        model.base_model.first_kv_shared_layer_idx = self.num_hidden_layers
