from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding
from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer, Gemma2RotaryEmbedding
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer, Gemma4TextRotaryEmbedding

from petals.block import RotaryBlockMixin


class GemmaBlock(RotaryBlockMixin, GemmaDecoderLayer):
    """One Gemma layer: multi-query or GQA attention, then a GeGLU MLP; norms scale by ``1 + weight``."""

    rotary_class = GemmaRotaryEmbedding


class Gemma2Block(RotaryBlockMixin, Gemma2DecoderLayer):
    """One Gemma 2 layer: attention with soft-capped scores (sliding on the layers ``layer_types`` says),
    norms before and after both attention and MLP."""

    rotary_class = Gemma2RotaryEmbedding


class Gemma3Block(RotaryBlockMixin, Gemma3DecoderLayer):
    """One Gemma 3 layer: Gemma 2's with query and key norms, and a rotary embedding per layer type
    (local sliding layers and global full ones differ in base)."""

    rotary_class = Gemma3RotaryEmbedding


class Gemma4Block(RotaryBlockMixin, Gemma4TextDecoderLayer):
    """One Gemma 4 layer: Gemma 3's, with wider heads on full layers (keys doubling as values where
    ``attention_k_eq_v``), an optional mixture of experts beside the MLP, and a learned output scale."""

    rotary_class = Gemma4TextRotaryEmbedding

    def forward(self, hidden_states, cache=None, shared_kv_states: dict | None = None):
        """``shared_kv_states``: the keys and values of this pass's layers that store them, by layer type
        (core hands one dict to every block of a pass); a layer that reuses them needs its source's."""
        if shared_kv_states is None:
            shared_kv_states = {}  # a block run alone: a storing layer keeps them for no one
        if self.self_attn.is_kv_shared_layer and self.layer_type not in shared_kv_states:
            raise ValueError(
                f"block {self.block_index} reuses the keys and values of an earlier {self.layer_type} layer, "
                "which did not run before it in this pass"
            )
        return super().forward(hidden_states, cache, shared_kv_states=shared_kv_states)
