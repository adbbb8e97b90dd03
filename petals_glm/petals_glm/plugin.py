"""Entry point of the GLM plugin: registration only. Every other hook keeps core's default."""

from petals import hookimpl
from petals_glm.config import (
    DistributedGlm4Config,
    DistributedGlm4MoeConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGlm4Config)
    register(DistributedGlm4MoeConfig)
