"""How a Llama block splits over devices: attention by key/value groups, the MLP by columns then rows."""

import tensor_parallel as tp
from tensor_parallel.state_actions import Scale, Split

from petals.convert.tensor_parallel import projection_attention_rules


def tensor_parallel_config(config, world_size: int) -> tp.Config:
    state_rules = {
        **projection_attention_rules(config, world_size),
        r".*mlp\.(gate|up)_proj\.(weight|bias)$": Split(world_size, dim=0),
        r".*mlp\.down_proj\.weight$": Split(world_size, dim=1),
    }
    if config.mlp_bias:
        state_rules[r".*mlp\.down_proj\.bias$"] = Scale(world_size)  # added once after the sum
    return tp.Config(
        state_rules=state_rules,
        input_rules={},
        output_rules={r"^self_attn$": {0: "sum"}, r"^mlp$": {0: "sum"}},
        attr_rules={},
    )
