"""How a Falcon block splits over devices, for each of its three fused-QKV layouts.

* new architecture: ``[kv group: its queries, key, value] * num_kv_heads`` → split by groups;
* RW (no multi-query): ``[head: query, key, value] * num_heads`` → split by heads;
* multi-query: ``[all queries, one key, one value]`` → queries split, the shared key/value kept by every shard.
  Where the attention repeats its key/value heads ``num_key_value_groups`` times (transformers 5.25 and later:
  the shared attention functions), that count is this shard's query heads too.

With ALiBi (RW models) each shard takes its heads' slice of the bias and of the per-head mask.
"""

from collections.abc import Sequence
from functools import partial

import tensor_parallel as tp
import torch
from tensor_parallel.aux_actions import split_num_heads
from tensor_parallel.state_actions import Scale, Split, SplitInChunks, StateAction
from transformers.models.falcon.modeling_falcon import FalconAttention

from petals.convert.tensor_parallel import head_splitter


class SplitQueriesKeepSharedKeyValue(StateAction):
    """Multi-query fused QKV rows: this shard's query heads, then the one key and one value head."""

    def __init__(self, world_size: int, head_dim: int) -> None:
        self.world_size, self.head_dim = world_size, head_dim

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        queries, shared = tensor[: -2 * self.head_dim], tensor[-2 * self.head_dim :]
        return torch.cat([queries.tensor_split(self.world_size)[rank], shared])

    def undo(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        queries = [tensor[: -2 * self.head_dim].cpu() for tensor in tensors]
        return torch.cat([*queries, tensors[0][-2 * self.head_dim :].cpu()])


def repeats_key_value_heads(config) -> bool:
    """Whether Falcon's attention repeats each key/value head for ``num_key_value_groups`` query heads, a count
    it sets at init (5.25 and later); 5.24 computes attention itself, from the heads as split."""
    with torch.device("meta"):
        return hasattr(FalconAttention(config), "num_key_value_groups")


def tensor_parallel_config(config, world_size: int) -> tp.Config:
    num_heads = config.num_attention_heads
    head_dim = config.hidden_size // num_heads
    split_heads = partial(split_num_heads, world_size=world_size)
    head_counts = {"num_heads": split_heads}
    if config.new_decoder_architecture:
        group_size = num_heads // config.num_kv_heads
        qkv = SplitInChunks(world_size, dim=0, chunk_size=(group_size + 2) * head_dim)
        head_counts["num_kv_heads"] = split_heads
    elif config.multi_query:
        qkv = SplitQueriesKeepSharedKeyValue(world_size, head_dim)
        if repeats_key_value_heads(config):  # the one shared head serves this shard's queries, not all
            head_counts["num_key_value_groups"] = split_heads
    else:
        qkv = SplitInChunks(world_size, dim=0, chunk_size=3 * head_dim)
        head_counts["num_kv_heads"] = split_heads
    per_head = head_splitter(num_heads, world_size)
    state_rules = {
        r".*self_attention\.query_key_value\.(weight|bias)$": qkv,
        r".*self_attention\.dense\.weight$": SplitInChunks(world_size, dim=1, chunk_size=head_dim),
        r".*mlp\.dense_h_to_4h\.(weight|bias)$": Split(world_size, dim=0),
        r".*mlp\.dense_4h_to_h\.weight$": Split(world_size, dim=1),
    }
    if config.bias:  # row-parallel biases are added once, after the sum
        state_rules[r".*(self_attention\.dense|mlp\.dense_4h_to_h)\.bias$"] = Scale(world_size)
    return tp.Config(
        state_rules=state_rules,
        input_rules={r"^self_attention$": {"alibi": per_head, "attention_mask": per_head}},
        output_rules={r"^self_attention$": {0: "sum"}, r"^mlp$": {0: "sum"}},
        attr_rules={r"^self_attention$": head_counts},
    )
