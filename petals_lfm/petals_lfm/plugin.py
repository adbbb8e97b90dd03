"""Entry point of the LFM plugin: registration.

Transformers names LFM2's short-convolution layers ``conv``: each keeps, per sequence, the last
``conv_L_cache`` inputs of its depthwise convolution over ``hidden_size`` channels, and nothing else,
whatever the sequence's length. Core's default cache description measures that state from the block
(a fixed-size state without a recurrent part) and sizes the attention layers' keys and values from
the attention's own projections."""

from petals import hookimpl
from petals_lfm.config import DistributedLfm2Config


@hookimpl
def register_model_families(register) -> None:
    register(DistributedLfm2Config)
