"""petals-qwen2 passes the petals-core conformance kit, sliding-window layers included."""

import pytest

from petals.testing import check_family, check_prefix_rules
from qwen2_tiny import tiny_qwen2


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
