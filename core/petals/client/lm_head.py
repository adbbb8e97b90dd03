"""The local LM head, computed in vocabulary chunks so a 128k-token vocabulary fits in CPU memory.

Half-precision weights on CPU are multiplied chunk by chunk in float32 (``chunked_forward_step``
rows at a time) instead of converting the whole matrix at once; anything else is a plain linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HALF_DTYPES = (torch.float16, torch.bfloat16)


class ChunkedLMHead(nn.Linear):
    """An ``nn.Linear`` (so weight tying works as usual) with ``LMHeadConfig``'s chunked forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.use_chunked_forward = config.use_chunked_forward
        self.chunk_size = config.chunked_forward_step

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._chunked():
            return F.linear(hidden_states.to(self.weight.dtype), self.weight, self.bias)
        hidden = hidden_states.float()
        logits = hidden.new_empty(*hidden.shape[:-1], self.out_features)
        for start in range(0, self.out_features, self.chunk_size):
            end = min(start + self.chunk_size, self.out_features)
            bias = self.bias[start:end].float() if self.bias is not None else None
            logits[..., start:end] = F.linear(hidden, self.weight[start:end].float(), bias)
        return logits

    def _chunked(self) -> bool:
        if self.use_chunked_forward == "auto":
            return self.weight.dtype in HALF_DTYPES and self.weight.device.type == "cpu"
        return bool(self.use_chunked_forward)
