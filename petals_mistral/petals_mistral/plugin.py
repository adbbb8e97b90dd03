"""Entry point of the Mistral plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("mistralai/Mistral-7B-v0.1" ->
"Mistral-7B-v0-1"), and core's cache description already knows Mistral's sliding window."""

from petals import hookimpl
from petals_mistral.config import DistributedMinistral3Config, DistributedMistralConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedMistralConfig)
    register(DistributedMinistral3Config)
