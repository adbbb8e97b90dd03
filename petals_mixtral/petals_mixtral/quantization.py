"""Mixtral's fused experts rebuilt as one quantized linear pair per expert.

transformers 5 stores all experts as two 3-D parameters (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``), which bitsandbytes cannot quantize as they are. ``QuantizedExperts``
holds one ``gate_up`` and one ``down`` linear per expert, made by core's ``quantize_linear``,
and routes tokens exactly as ``MixtralExperts`` does.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.models.mixtral.modeling_mixtral import MixtralExperts


class QuantizedExperts(nn.Module):
    def __init__(self, experts: MixtralExperts, quantize_linear: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.gate_up = nn.ModuleList(quantize_linear(_linear(w)) for w in experts.gate_up_proj.data)
        self.down = nn.ModuleList(quantize_linear(_linear(w)) for w in experts.down_proj.data)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            gate, up = self.gate_up[expert](hidden_states[token_idx]).chunk(2, dim=-1)
            output = self.down[expert](self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, output.to(final_hidden_states.dtype))
        return final_hidden_states


def _linear(weight: torch.Tensor) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
