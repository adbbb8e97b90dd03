"""Entry point of the Granite plugin: registration only. Every other hook keeps core's default."""

from petals import hookimpl
from petals_granite.config import (
    DistributedGraniteConfig,
    DistributedGraniteMoeConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGraniteConfig)
    register(DistributedGraniteMoeConfig)
