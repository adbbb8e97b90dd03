"""Entry point of the Gemma plugin: registration, and the cache of Gemma 4's layers (their head sizes
differ by layer type: ``petals_gemma.gemma4``). Every other hook keeps core's default: the dht_prefix is
the repo's last path part with "." replaced by "-" ("google/gemma-3-1b-it" -> "gemma-3-1b-it"), and
core's cache description already knows the sliding layers of Gemma 2 and 3. The scaled embeddings (by
the square root of the hidden size) and soft-capped logits run on the client, in transformers' own
modules."""

from petals import hookimpl
from petals_gemma.config import (
    DistributedGemma2Config,
    DistributedGemma3TextConfig,
    DistributedGemma4TextConfig,
    DistributedGemmaConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGemmaConfig)
    register(DistributedGemma2Config)
    register(DistributedGemma3TextConfig)
    register(DistributedGemma4TextConfig)


@hookimpl
def cache_spec(config, block_index: int):
    if config.model_type != "gemma4_text":
        return None
    from petals_gemma import gemma4

    return gemma4.cache_spec(config, block_index)
