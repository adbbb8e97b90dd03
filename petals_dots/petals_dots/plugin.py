"""Entry point of the dots plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("rednote-hilab/dots.llm1.inst" ->
"dots-llm1-inst"), and core's cache description knows the sliding and full-attention layers from
``layer_types``."""

from petals import hookimpl
from petals_dots.config import DistributedDots1Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedDots1Config)
