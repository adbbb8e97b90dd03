from transformers import Lfm2Config

from petals.config import DistributedConfigMixin, LazyClass


class DistributedLfm2Config(DistributedConfigMixin, Lfm2Config):
    """LFM2: gated short-convolution layers (``conv`` in ``layer_types``) between full-attention ones."""

    block_class = LazyClass("petals_lfm.block:Lfm2Block")
    attn_class = LazyClass("transformers.models.lfm2.modeling_lfm2:Lfm2Attention")
    block_prefix = "model.layers"
