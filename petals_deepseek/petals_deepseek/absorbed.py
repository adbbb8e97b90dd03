"""DeepSeek's latent attention computed on the cached latent itself, without expanding it per head.

Why this exists: servers cache DeepSeek's compressed latent (``kv_lora_rank`` values) and shared rope
key (``qk_rope_head_dim`` values) per token, 71 times less than expanded keys and values for V3 (core's
``petals.kv_cache.specs.latent_widths``). transformers 5.24's attention caches the same, then runs
``kv_b_proj`` over every cached token at every step to expand per-head keys and values: ``kv_lora_rank
x heads x (qk_nope + v_head_dim)`` multiply-adds per cached token per step.
``python -m benchmarks.deepseek_latent`` (one layer with V3's head dims and yarn rope, 16 heads, hidden
2048, fp32, 2 shared CPU cores) measured that form at 5-8x the decode time of an expanded cache at
2k-8k tokens of context; the cost grows with the heads (128 in V3).

Weight absorption: with ``W_UK`` and ``W_UV`` the key and value parts of ``kv_b_proj``'s weight, per
head ``[qk_nope x kv_lora_rank]`` and ``[v_head_dim x kv_lora_rank]``, a head's score of a cached token
is ``(q_nope @ W_UK) . latent + q_rope . k_rope`` and its output ``(softmax @ latent) @ W_UV^T``: the
step's queries move into the latent space (``heads x qk_nope x kv_lora_rank`` multiply-adds per query
token), and every head reads the same cached latent. Per step of ``L`` query tokens over ``T`` cached
ones and per head, that costs ``L (qk_nope + v) r + T L (2 r + rope)`` against the expansion's
``T (qk_nope + v) r + T L (qk_nope + rope + v)`` (``r`` = ``kv_lora_rank``): absorption wins while
``L`` is small against ``T`` (decoding, short steps), expansion for a prefill (``L`` = ``T``).
``absorption_pays`` picks by that count. Measured on that layer (2 shared cores at load 3-6, so
noisy): one decode token at 512 / 2,048 / 8,192 tokens of context took 8 / 12 / 14 ms served
absorbed, 38 / 163 / 565 ms in transformers' form and 15 / 18 / 77 ms with an expanded cache; a step
of L tokens over 2,048 cached ones took 0.08-0.09x (L = 1), 0.4-0.6x (64), 0.7-0.9x (128), 0.8-1.0x
(192), 1.2-1.5x (256) and 1.0-1.2x (512) the expanded path's time in two sweeps: the break-even lies
near L = 200, and the count's is L = 171.

The absorbed form is used only where it is exact against transformers' and cheap to set up:
``kv_b_proj`` a plain ``nn.Linear`` with a plain floating-point weight, in eval mode. A quantized
``kv_b_proj`` (``--quant_type`` int8 or nf4: bitsandbytes' layers, whose weight is packed) or a LoRA
adapter on it (peft wraps the layer) falls back to transformers' own forward, as does training
(attention dropout). Tensor parallelism: the plugin gives no ``tensor_parallel_config`` for DeepSeek,
so blocks are never sharded; the head count is read from ``kv_b_proj``'s weight, not the config,
should a plan split it by heads.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, apply_rotary_emb
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    eager_attention_forward as v2_eager_attention_forward,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    eager_attention_forward as v3_eager_attention_forward,
)

from petals.formats.packed import PackedWeight


def absorption_pays(query_tokens: int, context: int, *, rank: int, nope: int, rope: int, value: int) -> bool:
    """Whether a step of ``query_tokens`` over ``context`` cached tokens (the step's own included)
    costs fewer multiply-adds per head absorbed than expanded (see the module docstring)."""
    absorbed = query_tokens * (nope + value) * rank + context * query_tokens * (2 * rank + rope)
    expanded = context * (nope + value) * rank + context * query_tokens * (nope + rope + value)
    return absorbed < expanded


class LatentAbsorption:
    """Mixed in front of transformers' DeepSeek attention: the same weights and cache writes, the
    attention computed absorbed where that is cheaper (``absorption_pays``), expanded otherwise."""

    eager_attention = staticmethod(v3_eager_attention_forward)
    _absorbed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rotate(self, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings) -> tuple:
        raise NotImplementedError

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(W_UK [heads, qk_nope, rank], W_UV^T [heads, rank, v])``, views of ``kv_b_proj``'s weight made
        once per weight tensor; None where the absorbed form does not apply (see the module docstring)."""
        projection = self.kv_b_proj
        if self.training or type(projection) is not nn.Linear:  # bitsandbytes' layers subclass nn.Linear
            return None
        weight = projection.weight
        if isinstance(weight, PackedWeight):  # held in its checkpoint's encoding: dequantized for this step
            weight = weight.dequantize()
        cached = self._absorbed
        if cached is not None and cached[0] is weight:
            return cached[1], cached[2]
        if type(weight.data) is not torch.Tensor or not weight.is_floating_point() or weight.is_meta:
            return None
        nope, rank = self.qk_nope_head_dim, weight.shape[1]
        per_head = weight.detach().view(-1, nope + self.v_head_dim, rank)
        self._absorbed = (weight, per_head[:, :nope], per_head[:, nope:].transpose(1, 2))
        return self._absorbed[1], self._absorbed[2]

    def _apply(self, fn, *args, **kwargs):
        self._absorbed = None  # .to() / .half() make new weights: views of the old ones must not keep them
        return super()._apply(fn, *args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        weights = self.absorbed_weights()
        if weights is None:
            return super().forward(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                **kwargs,
            )
        batch, length = hidden_states.shape[:-1]
        nope, rope, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            queries = self.q_proj(hidden_states)
        else:
            queries = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        queries = queries.view(batch, length, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = queries.split([nope, rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([rank, rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(batch, 1, length, rank)
        k_rot = k_rot.view(batch, 1, length, rope)
        q_rot, k_rot = self.rotate(q_rot, k_rot, position_embeddings)
        if cache is not None:  # written and read back still compressed, as transformers does
            latent, k_rot = cache.update(latent, k_rot, self.layer_idx, kwargs=kwargs)

        if absorption_pays(length, latent.shape[-2], rank=rank, nope=nope, rope=rope, value=self.v_head_dim):
            output = self._absorbed_attention(q_nope, q_rot, latent, k_rot, attention_mask, *weights)
        else:
            output = self._expanded_attention(q_nope, q_rot, latent, k_rot, attention_mask, **kwargs)
        return self.o_proj(output), None

    def _expanded_attention(self, q_nope, q_rot, latent, k_rot, attention_mask, **kwargs) -> torch.Tensor:
        """transformers' own computation after the cache update: keys and values expanded per head."""
        batch, _, length, _ = q_nope.shape
        keys, values = self.expand_kv(latent, k_rot)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self.eager_attention
        )
        output, _ = attention(
            self,
            torch.cat((q_nope, q_rot), dim=-1),
            keys,
            values,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return output.reshape(batch, length, -1)

    def _absorbed_attention(
        self,
        q_nope: torch.Tensor,  # [batch, heads, length, qk_nope]
        q_rot: torch.Tensor,  # [batch, heads, length, rope], rotated
        latent: torch.Tensor,  # [batch, 1, context, rank], the cache's history with this step
        k_rot: torch.Tensor,  # [batch, 1, context, rope]
        attention_mask: torch.Tensor | None,  # [batch, 1, length, >= context], bool or additive, or None
        w_uk: torch.Tensor,  # [heads, qk_nope, rank]
        w_uv_t: torch.Tensor,  # [heads, rank, v]
    ) -> torch.Tensor:
        batch, heads, length, nope = q_nope.shape
        context, rank = latent.shape[-2], latent.shape[-1]
        # every head's queries in the latent space: [heads, batch * length, rank], one matmul per head
        q_latent = torch.bmm(q_nope.transpose(0, 1).reshape(heads, batch * length, nope), w_uk)
        q_latent = (
            q_latent.view(heads, batch, length, rank).transpose(0, 1).reshape(batch, heads * length, rank)
        )
        latent, k_rot = latent[:, 0], k_rot[:, 0]  # one "head", read by all: [batch, context, width]
        # scores [batch, heads * length, context]: rope part, plus the latent part, both scaled; in float32
        # for half dtypes, as sdpa keeps them (rounded to bfloat16, scores summed over 512 latent values put
        # outputs 1.8x as far from float32's as the expanded form's are; 1.2x kept in float32)
        wide = torch.float32 if latent.dtype in (torch.float16, torch.bfloat16) else latent.dtype
        scores = torch.bmm(q_rot.reshape(batch, heads * length, -1).to(wide), k_rot.transpose(1, 2).to(wide))
        scores = torch.baddbmm(
            scores, q_latent.to(wide), latent.transpose(1, 2).to(wide), beta=self.scaling, alpha=self.scaling
        )
        scores = scores.view(batch, heads, length, context)
        if attention_mask is not None:
            attention_mask = attention_mask[..., :context]
            if attention_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attention_mask, float("-inf"))
            else:
                scores = scores + attention_mask
        elif length > 1:  # each of the step's tokens sees the history and the step up to itself
            positions = torch.arange(context, device=scores.device)
            causal = positions[None, :] <= positions[context - length :, None]
            scores = scores.masked_fill(~causal, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
        # the heads' weighted latents [batch, heads * length, rank], then each head's way out through W_UV
        out_latent = torch.bmm(weights.view(batch, heads * length, context), latent)
        out_latent = (
            out_latent.view(batch, heads, length, rank).transpose(0, 1).reshape(heads, batch * length, rank)
        )
        output = torch.bmm(out_latent, w_uv_t)  # [heads, batch * length, v]
        return output.view(heads, batch, length, -1).permute(1, 2, 0, 3).reshape(batch, length, -1)


class AbsorbedDeepseekV3Attention(LatentAbsorption, DeepseekV3Attention):
    """DeepSeek V3's attention, absorbed where that is cheaper."""

    def rotate(self, q_rot, k_rot, position_embeddings):
        cos, sin = position_embeddings
        rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
        return rotate(q_rot, k_rot, cos, sin)


class AbsorbedDeepseekV2Attention(LatentAbsorption, DeepseekV2Attention):
    """DeepSeek V2's attention (complex rotary embeddings), absorbed where that is cheaper."""

    eager_attention = staticmethod(v2_eager_attention_forward)

    def rotate(self, q_rot, k_rot, position_embeddings):
        return apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))
