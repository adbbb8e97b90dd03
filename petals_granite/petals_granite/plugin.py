"""Entry point of the Granite plugin: registration only. Every other hook keeps core's default.

Granite's four multipliers need no code here. ``attention_multiplier`` (the attention scale) and
``residual_multiplier`` live in the decoder layer, so the servers' blocks apply them;
``embedding_multiplier`` and ``logits_scaling`` live in ``GraniteModel``/``GraniteForCausalLM``, which
the client runs itself with its layer list replaced by the remote blocks, so transformers applies them
on the client as it does locally."""

from petals import hookimpl
from petals_granite.config import (
    DistributedGraniteConfig,
    DistributedGraniteMoeConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGraniteConfig)
    register(DistributedGraniteMoeConfig)
