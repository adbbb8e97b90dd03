from transformers.models.dots1.modeling_dots1 import Dots1DecoderLayer, Dots1RotaryEmbedding

from petals.block import RotaryBlockMixin


class Dots1Block(RotaryBlockMixin, Dots1DecoderLayer):
    """One dots.llm1 layer: attention with per-head q/k norms (sliding from ``max_window_layers`` on,
    when a window is set), then a dense MLP (the first ``first_k_dense_replace`` layers) or a shared
    expert and routed experts (sigmoid scores, group-limited routing)."""

    rotary_class = Dots1RotaryEmbedding
