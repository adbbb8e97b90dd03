"""Entry point of the Gemma plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("google/gemma-3-1b-it" ->
"gemma-3-1b-it"), and core's cache description already knows the sliding layers of Gemma 2 and 3.
The scaled embeddings (by the square root of the hidden size) run on the client, in transformers' own
embedding module."""

from petals import hookimpl
from petals_gemma.config import DistributedGemma2Config, DistributedGemma3TextConfig, DistributedGemmaConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGemmaConfig)
    register(DistributedGemma2Config)
    register(DistributedGemma3TextConfig)
