"""Entry point of the Qwen plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("Qwen/Qwen3-Next-80B-A3B-Instruct"
-> "Qwen3-Next-80B-A3B-Instruct"), and core's cache description already knows the gated delta net
layers of Qwen3-Next and Qwen3.5 (a fixed-size state per sequence) and the sliding layers of Qwen3 and
Qwen2 MoE.

Qwen3.5 is served by its language model's types (``qwen3_5_text``, ``qwen3_5_moe_text``): the
multimodal checkpoints (``qwen3_5``, ``qwen3_5_moe``) nest it under ``text_config`` beside a vision
tower that petals-core does not serve."""

from petals import hookimpl
from petals_qwen.config import (
    DistributedQwen2MoeConfig,
    DistributedQwen3_5MoeTextConfig,
    DistributedQwen3_5TextConfig,
    DistributedQwen3Config,
    DistributedQwen3MoeConfig,
    DistributedQwen3NextConfig,
)


@hookimpl
def register_model_families(register) -> None:
    register(DistributedQwen3Config)
    register(DistributedQwen3MoeConfig)
    register(DistributedQwen3NextConfig)
    register(DistributedQwen2MoeConfig)
    register(DistributedQwen3_5TextConfig)
    register(DistributedQwen3_5MoeTextConfig)
