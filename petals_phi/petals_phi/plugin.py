"""Entry point of the Phi plugin: registration only. Every other hook keeps core's default."""

from petals import hookimpl
from petals_phi.config import (
    DistributedPhi3Config,
    DistributedPhimoeConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedPhi3Config)
    register(DistributedPhimoeConfig)
