"""Entry point of the GLM plugin: registration only. Every other hook keeps core's default.

GLM-5's ``glm_moe_dsa`` is not registered: its sparse attention keeps, beside the latent, an indexer key
per token (``cache.update_indexer``), a cache kind petals-core does not serve yet (the kit stops at
"indexed attention layer, which petals-core cannot cache yet")."""

from petals import hookimpl
from petals_glm.config import (
    DistributedGlm4Config,
    DistributedGlm4MoeConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGlm4Config)
    register(DistributedGlm4MoeConfig)
