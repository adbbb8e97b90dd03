"""``petals.testing``: the conformance kit every model-family plugin runs (our ``pytester``), and the
client options that keep a test's client peer on 127.0.0.1 (``LOOPBACK_CLIENT``, what
``from_pretrained(..., loopback=True)`` passes).

from petals.testing import check_family

def test_my_family_conforms(tmp_path):
    check_family(MyHFConfig(hidden_size=64, num_hidden_layers=4, ...), tmp_path)

``check_structure(config, tmp_path)`` runs the checks that need no weights, on a real model's config.

Local swarms for tests: ``petals.testing.swarm`` (processes) and ``petals.testing.inprocess``.
"""

from petals.network.client import LOOPBACK_CLIENT
from petals.testing.conformance import (
    ConformanceReport,
    StepSchedule,
    check_family,
    check_prefix_rules,
    check_structure,
)

__all__ = [
    "LOOPBACK_CLIENT",
    "ConformanceReport",
    "StepSchedule",
    "check_family",
    "check_prefix_rules",
    "check_structure",
]
