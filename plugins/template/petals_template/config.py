from transformers import MistralConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedMistralConfig(DistributedConfigMixin, MistralConfig):
    # LazyClass: the torch modeling code is imported only when a server builds a block
    block_class = LazyClass("petals_template.block:MistralBlock")
    attn_class = LazyClass("transformers.models.mistral.modeling_mistral:MistralAttention")
    block_prefix = "model.layers"  # where the layer list lives in MistralForCausalLM's state dict
