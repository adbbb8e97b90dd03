"""End to end: a tiny Qwen2 served by two real servers (in this process) generates what transformers does."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import petals
from petals.testing.swarm import LOOPBACK_CLIENT, inprocess_swarm
from qwen2_tiny import tiny_qwen2


@pytest.fixture(scope="module")
def tiny_qwen2_path(tmp_path_factory):
    config = tiny_qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def test_two_servers_generate_the_same_greedy_tokens_as_transformers(tiny_qwen2_path):
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    local = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32).eval()
    expected = local.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with inprocess_swarm(tiny_qwen2_path, "0:2", "2:4") as (dht, _):
        remote = petals.AutoDistributedModelForCausalLM.from_pretrained(
            tiny_qwen2_path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        try:
            got = remote.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        finally:
            remote.remote_blocks.network.close()
    assert torch.equal(got, expected)
