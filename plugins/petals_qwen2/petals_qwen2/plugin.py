"""Entry point of the Qwen2 plugin: the family registers; every other hook keeps core's default
(dht_prefix: the repo's last path part with "." replaced by "-", e.g. "Qwen2-0-5B-Instruct")."""

from petals import hookimpl
from petals_qwen2.config import DistributedQwen2Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedQwen2Config)
