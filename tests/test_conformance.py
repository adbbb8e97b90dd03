"""Every first-party family passes the conformance kit, and the kit catches a wrong block."""

import pytest
import torch

from conftest import TINY_CONFIGS, tiny_config
from petals import hookimpl
from petals.plugins import get_plugin_manager
from petals.testing import check_family


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_family_passes_conformance_kit(variant, tmp_path):
    report = check_family(tiny_config(variant), tmp_path)
    assert len(report.max_abs_diff) == 13  # no-cache forward, prefill, 8 steps, chunk, reorder, rewind
    assert max(report.max_abs_diff.values()) <= 1e-5


class WrongPositionsBlockPlugin:
    """A plugin whose block forgets the cached length when placing new tokens (a classic bug)."""

    @hookimpl
    def block_class(self, config):
        from petals_llama.block import LlamaBlock

        class ForgetfulBlock(LlamaBlock):
            def position_ids(self, hidden_states, cache):
                return torch.arange(hidden_states.shape[1])[None]

        return ForgetfulBlock if config.model_type == "llama" else None


def test_kit_catches_a_block_that_ignores_cached_positions(tmp_path):
    manager = get_plugin_manager()
    manager.register(WrongPositionsBlockPlugin(), name="wrong-positions")
    try:
        with pytest.raises(AssertionError, match=r"step 1 \(1 tokens\): max \|logits diff\|"):
            check_family(tiny_config("llama"), tmp_path)
    finally:
        manager.unregister(name="wrong-positions")
