"""Entry point of the MiniMax plugin: registration only. Every other hook keeps core's default: the
dht_prefix is the repo's last path part ("MiniMaxAI/MiniMax-M2" -> "MiniMax-M2"), and every layer
caches full attention.

MiniMax-Text-01 and MiniMax-M1 (``minimax``) are not registered: their lightning-attention layers keep
a decayed key-value state that is not a gated delta net's, a linear-attention kind petals-core's
``LinearAttentionSpec`` does not describe yet."""

from petals import hookimpl
from petals_minimax.config import DistributedMiniMaxM2Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedMiniMaxM2Config)
