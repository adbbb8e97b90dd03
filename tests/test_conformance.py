"""Every first-party family passes the conformance kit, and the kit catches a wrong block."""

import pytest
import torch

from conftest import TINY_CONFIGS, LlamaFamilyPlugin, serving_only, tiny_config
from petals.kv_cache import PAGE_TOKENS
from petals.testing import check_family
from petals_llama.block import LlamaBlock
from petals_llama.config import DistributedLlamaConfig


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_family_passes_conformance_kit(variant, tmp_path):
    report = check_family(tiny_config(variant), tmp_path)
    # no-cache forward, prefill, 8 steps, chunk, reorder, rewind, a resumed session, failover's history
    # and next step
    assert len(report.max_abs_diff) == 16
    assert max(report.max_abs_diff.values()) <= 1e-5


class ForgetfulBlock(LlamaBlock):
    """Forgets the cached length when placing new tokens (a classic bug)."""

    def position_ids(self, hidden_states, cache):
        return torch.arange(hidden_states.shape[1])[None]


class ForgetfulLlamaConfig(DistributedLlamaConfig):
    block_class = ForgetfulBlock


class WrongPositionsFamily(LlamaFamilyPlugin):
    config_class = ForgetfulLlamaConfig


def test_kit_catches_a_block_that_ignores_cached_positions(tmp_path):
    with serving_only(WrongPositionsFamily(), name="wrong-positions"):
        with pytest.raises(AssertionError, match=r"step 1 \(1 tokens\): max \|logits diff\|"):
            check_family(tiny_config("llama"), tmp_path)


class PageBoundBlock(LlamaBlock):
    """Places a step's tokens right only within a page of the cache: a step longer than a page goes wrong
    (the kit's own steps are all shorter; a failover's replay of the whole history is not)."""

    def position_ids(self, hidden_states, cache):
        positions = super().position_ids(hidden_states, cache)
        if cache is None:
            return positions
        return positions[..., :1] + torch.arange(hidden_states.shape[1]) % PAGE_TOKENS


class PageBoundLlamaConfig(DistributedLlamaConfig):
    block_class = PageBoundBlock


class PageBoundFamily(LlamaFamilyPlugin):
    config_class = PageBoundLlamaConfig


def test_kit_catches_a_block_that_fails_a_failover_replay_of_the_history(tmp_path):
    with serving_only(PageBoundFamily(), name="page-bound"):
        with pytest.raises(
            AssertionError, match=r"llama history replayed onto fresh caches: max \|logits diff\|"
        ):
            check_family(tiny_config("llama"), tmp_path)
