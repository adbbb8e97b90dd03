from transformers import AutoConfig, MistralConfig

from petals.config import DistributedConfigMixin, LazyClass


class TemplateConfig(MistralConfig):
    """The family's Hugging Face config. Your plugin uses its model's own config class instead; the
    template invents the model type "petals_template" (run by Mistral's code) so that, installed,
    it never claims a real model's type."""

    model_type = "petals_template"


AutoConfig.register(TemplateConfig.model_type, TemplateConfig)  # only a made-up model type needs this


class DistributedTemplateConfig(DistributedConfigMixin, TemplateConfig):
    # LazyClass: the torch modeling code is imported only when a server builds a block
    block_class = LazyClass("petals_template.block:TemplateBlock")
    attn_class = LazyClass("transformers.models.mistral.modeling_mistral:MistralAttention")
    block_prefix = "model.layers"  # where the layer list lives in the causal LM's state dict
