from transformers import Llama4TextConfig, LlamaConfig, SmolLM3Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedLlamaConfig(DistributedConfigMixin, LlamaConfig):
    block_class = LazyClass("petals_llama.block:LlamaBlock")
    attn_class = LazyClass("transformers.models.llama.modeling_llama:LlamaAttention")
    block_prefix = "model.layers"


class DistributedLlama4TextConfig(DistributedConfigMixin, Llama4TextConfig):
    """Llama 4 (text): chunked attention on the rope layers, full attention on the no-rope ones (core's
    default ``cache_spec`` keeps a chunk per sequence for the former); experts every
    ``interleave_moe_layer_step`` layers."""

    block_class = LazyClass("petals_llama.block:Llama4TextBlock")
    attn_class = LazyClass("transformers.models.llama4.modeling_llama4:Llama4TextAttention")
    block_prefix = "model.layers"


class DistributedSmolLM3Config(DistributedConfigMixin, SmolLM3Config):
    block_class = LazyClass("petals_llama.block:SmolLM3Block")
    attn_class = LazyClass("transformers.models.smollm3.modeling_smollm3:SmolLM3Attention")
    block_prefix = "model.layers"
