"""Entry point of the GPT-OSS plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part with "." replaced by "-" ("openai/gpt-oss-20b" ->
"gpt-oss-20b"), and core's cache description already knows the sliding layers."""

from petals import hookimpl
from petals_gpt_oss.config import DistributedGptOssConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedGptOssConfig)
