"""Entry point of the Cohere plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part ("CohereLabs/c4ai-command-r7b-12-2024" -> "c4ai-command-r7b-12-2024"),
and core's cache description knows the sliding and full-attention layers from ``layer_types``. The
logit scale is applied by the client's head (transformers' own model), not by the servers."""

from petals import hookimpl
from petals_cohere.config import DistributedCohere2Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedCohere2Config)
