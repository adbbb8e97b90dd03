"""Entry point of the GLM plugin: registration, and the cache of GLM-5's sparse attention.

GLM-5 (``glm_moe_dsa``) attends with DeepSeek's latent attention over the tokens a sparse-attention
indexer picks. Its layers hand the cache the compressed latent (``kv_lora_rank`` values) and one rope
key shared by all heads (``qk_rope_head_dim``), and, through ``cache.update_indexer``, one indexer key
of ``index_head_dim`` values per token. Core's default would size the cache from the expanded heads;
``cache_spec`` describes what is kept: for GLM-5's published config, 512 + 64 + 128 = 704 values per
token per layer against 64 heads x (256 key + 256 value) = 32,768 expanded, 46.5 times less. Every
other hook keeps core's default.
"""

from petals import hookimpl
from petals_glm.config import (
    DistributedGlm4Config,
    DistributedGlm4MoeConfig,
    DistributedGlmMoeDsaConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGlm4Config)
    register(DistributedGlm4MoeConfig)
    register(DistributedGlmMoeDsaConfig)


@hookimpl
def cache_spec(config, block_index: int):
    """GLM-5's layers (the only ones here with an indexer): one key/value "head" per token, the latent as
    its key and the shared rope key as its value, read by all query heads, and the indexer key beside
    them. GLM-4's layers: core's default (None)."""
    if config.model_type != "glm_moe_dsa":
        return None
    from petals.kv_cache import IndexedAttentionSpec

    return IndexedAttentionSpec(
        num_kv_heads=1,
        key_dim=config.kv_lora_rank,
        value_dim=config.qk_rope_head_dim,
        num_query_heads=config.num_attention_heads,
        index_dim=config.index_head_dim,
    )
