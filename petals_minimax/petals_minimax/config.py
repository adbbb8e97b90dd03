from transformers import MiniMaxM2Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedMiniMaxM2Config(DistributedConfigMixin, MiniMaxM2Config):
    block_class = LazyClass("petals_minimax.block:MiniMaxM2Block")
    attn_class = LazyClass("transformers.models.minimax_m2.modeling_minimax_m2:MiniMaxM2Attention")
    block_prefix = "model.layers"
