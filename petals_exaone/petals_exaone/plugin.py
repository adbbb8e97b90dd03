"""Entry point of the EXAONE plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("LGAI-EXAONE/EXAONE-4.0-32B" ->
"EXAONE-4-0-32B"), and core's cache description knows the sliding and full-attention layers from
``layer_types``."""

from petals import hookimpl
from petals_exaone.config import DistributedExaone4Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedExaone4Config)
