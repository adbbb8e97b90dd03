from transformers import Glm4Config, Glm4MoeConfig, GlmMoeDsaConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedGlm4Config(DistributedConfigMixin, Glm4Config):
    block_class = LazyClass("petals_glm.block:Glm4Block")
    attn_class = LazyClass("transformers.models.glm4.modeling_glm4:Glm4Attention")
    block_prefix = "model.layers"


class DistributedGlm4MoeConfig(DistributedConfigMixin, Glm4MoeConfig):
    block_class = LazyClass("petals_glm.block:Glm4MoeBlock")
    attn_class = LazyClass("transformers.models.glm4_moe.modeling_glm4_moe:Glm4MoeAttention")
    block_prefix = "model.layers"


class DistributedGlmMoeDsaConfig(DistributedConfigMixin, GlmMoeDsaConfig):
    """GLM-5: latent attention whose tokens are picked by a sparse-attention indexer in every layer.

    A layer whose indexer is ``"shared"`` (``indexer_types``) attends the tokens an earlier layer's
    indexer picked, handed from layer to layer inside the model: blocks served one by one, on servers
    that see only hidden states, cannot hand it on, so such configs are refused when they load."""

    block_class = LazyClass("petals_glm.block:GlmMoeDsaBlock")
    attn_class = LazyClass("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa:GlmMoeDsaAttention")
    block_prefix = "model.layers"
    block_output_is_tuple = True  # the HF layer returns (hidden states, the indexer's top-k)

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        shared = [index for index, kind in enumerate(self.indexer_types) if kind != "full"]
        if shared:
            raise ValueError(
                f"glm_moe_dsa layers {shared} reuse an earlier layer's indexer selection (indexer_types "
                "'shared'), which blocks served apart cannot hand on; petals-glm serves configs whose every "
                "layer has its own indexer (indexer_types all 'full')"
            )
