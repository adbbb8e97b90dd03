"""Entry point of the Qwen plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("Qwen/Qwen3-Next-80B-A3B-Instruct"
-> "Qwen3-Next-80B-A3B-Instruct"), and core's cache description already knows Qwen3-Next's gated
delta net layers (a fixed-size state per sequence) and the sliding layers of Qwen3 and Qwen2 MoE."""

from petals import hookimpl
from petals_qwen.config import (
    DistributedQwen2MoeConfig,
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
