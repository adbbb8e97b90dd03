"""Entry point of the ERNIE plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("baidu/ERNIE-4.5-21B-A3B-PT" ->
"ERNIE-4-5-21B-A3B-PT"), and every layer caches full attention. A block is built at its real layer
index, so it has experts or a dense MLP as the full model's layer of that index."""

from petals import hookimpl
from petals_ernie.config import DistributedErnie4_5_MoeConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedErnie4_5_MoeConfig)
