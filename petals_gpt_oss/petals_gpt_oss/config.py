from transformers import GptOssConfig

from petals.config import DistributedConfigMixin, LazyClass


class DistributedGptOssConfig(DistributedConfigMixin, GptOssConfig):
    """GPT-OSS: core runs its blocks with the attention transformers picks for the full model (eager,
    since sdpa would ignore the attention sinks)."""

    block_class = LazyClass("petals_gpt_oss.block:GptOssBlock")
    attn_class = LazyClass("transformers.models.gpt_oss.modeling_gpt_oss:GptOssAttention")
    block_prefix = "model.layers"
