"""How a BLOOM block splits over devices: fused QKV by heads (with their ALiBi slopes), the MLP by columns then rows.

BLOOM adds the residual inside its attention and MLP, so the row-parallel ``dense`` layers'
outputs are summed before that, and their biases are divided among the shards.
"""

from functools import partial

import tensor_parallel as tp
from tensor_parallel.aux_actions import split_num_heads
from tensor_parallel.state_actions import Scale, Split, SplitInChunks

from petals.convert.tensor_parallel import head_splitter


def tensor_parallel_config(config, world_size: int) -> tp.Config:
    head_dim = config.hidden_size // config.n_head
    return tp.Config(
        state_rules={
            r".*self_attention\.query_key_value\.(weight|bias)$": SplitInChunks(
                world_size, dim=0, chunk_size=3 * head_dim
            ),
            r".*self_attention\.dense\.weight$": SplitInChunks(world_size, dim=1, chunk_size=head_dim),
            r".*mlp\.dense_h_to_4h\.(weight|bias)$": Split(world_size, dim=0),
            r".*mlp\.dense_4h_to_h\.weight$": Split(world_size, dim=1),
            r".*(self_attention\.dense|mlp\.dense_4h_to_h)\.bias$": Scale(world_size),
        },
        input_rules={r"^self_attention$": {"alibi": head_splitter(config.n_head, world_size)}},
        output_rules={r".*self_attention\.dense$": {0: "sum"}, r".*mlp\.dense_4h_to_h$": {0: "sum"}},
        attr_rules={r"^self_attention$": {"num_heads": partial(split_num_heads, world_size=world_size)}},
    )
