"""petals-qwen2 passes the petals-core conformance kit, sliding-window layers included."""

import pytest
from transformers import Qwen2Config

from petals.testing import check_family, check_prefix_rules


def tiny_qwen2(**overrides) -> Qwen2Config:
    settings = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
    )
    return Qwen2Config(**(settings | overrides))


@pytest.mark.parametrize(
    "config",
    [tiny_qwen2(), tiny_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=2)],
    ids=["full-attention", "sliding-window-from-layer-2"],
)
def test_qwen2_conforms(config, tmp_path):
    report = check_family(config, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5


def test_qwen2_prefix_rule():
    check_prefix_rules({"Qwen/Qwen2-0.5B-Instruct": "Qwen2-0-5B-Instruct"}, tiny_qwen2())
