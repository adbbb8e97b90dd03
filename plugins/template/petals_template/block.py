from transformers import AutoModelForCausalLM
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralForCausalLM,
    MistralRotaryEmbedding,
)

from petals.block import RotaryBlockMixin
from petals_template.config import TemplateConfig


class TemplateBlock(RotaryBlockMixin, MistralDecoderLayer):
    """A rotary decoder layer needs no code of its own: the mixin calls it as transformers does.
    Layers with other calling conventions use ``petals.block.ServerBlockMixin`` and a ``forward``."""

    rotary_class = MistralRotaryEmbedding


class TemplateForCausalLM(MistralForCausalLM):
    """The made-up model type's full model (your family's comes with transformers or its own package)."""

    config_class = TemplateConfig


AutoModelForCausalLM.register(TemplateConfig, TemplateForCausalLM)
