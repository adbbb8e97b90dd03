from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

from petals.config import DistributedConfigMixin, LazyClass


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
