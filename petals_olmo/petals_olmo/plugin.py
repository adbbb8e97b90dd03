"""Entry point of the OLMo plugin: registration only. Every other hook keeps core's default."""

from petals import hookimpl
from petals_olmo.config import (
    DistributedOlmo2Config,
    DistributedOlmo3Config,
    DistributedOlmoeConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedOlmo2Config)
    register(DistributedOlmo3Config)
    register(DistributedOlmoeConfig)
