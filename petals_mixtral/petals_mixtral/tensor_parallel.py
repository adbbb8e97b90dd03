"""How a Mixtral block splits over devices: attention by key/value groups, every expert by columns then rows.

The router stays whole on every shard, so all shards route tokens alike; each computes its slice
of every expert's intermediate features, and the shards' partial outputs are summed.
"""

import tensor_parallel as tp
from tensor_parallel.state_actions import Split, SplitInGroupedChunks

from petals.convert.tensor_parallel import projection_attention_rules


def tensor_parallel_config(config, world_size: int) -> tp.Config:
    return tp.Config(
        state_rules={
            **projection_attention_rules(config, world_size),
            # [experts, gate rows + up rows, hidden]: split gate and up alike
            r".*mlp\.experts\.gate_up_proj$": SplitInGroupedChunks(
                world_size, dim=1, num_groups=2, chunk_size=1
            ),
            r".*mlp\.experts\.down_proj$": Split(world_size, dim=2),
        },
        input_rules={},
        output_rules={r"^self_attn$": {0: "sum"}, r"^mlp\.experts$": {0: "sum"}},
        attr_rules={},
    )
