"""``petals.testing``: the conformance kit every model-family plugin runs (our ``pytester``).

from petals.testing import check_family

def test_my_family_conforms(tmp_path):
    check_family(MyHFConfig(hidden_size=64, num_hidden_layers=4, ...), tmp_path)
"""

from petals.testing.conformance import ConformanceReport, StepSchedule, check_family, check_prefix_rules

__all__ = ["ConformanceReport", "StepSchedule", "check_family", "check_prefix_rules"]
