"""A long prefill does not stall other sessions: their decode steps run between its parts."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import inprocess_swarm
from petals.testing.wire_client import WireClient

HIDDEN, BLOCKS, PREFILL_TOKENS = 256, 4, 2000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server hosting all blocks of a Llama wide enough for a 2000-token prefill to take a while."""
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=BLOCKS,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=1000,
    )
    path = tmp_path_factory.mktemp("wide") / "wide-llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    with inprocess_swarm(path, f"0:{BLOCKS}") as (dht, (server,)):
        client = WireClient(dht.initial_peers)
        yield client, server.peer_id, [f"wide-llama-hf.{index}" for index in range(BLOCKS)]
        client.close()


def test_decode_steps_keep_completing_during_a_long_prefill(server):
    client, peer, uids = server
    decode = client.inference(peer, uids, max_length=PREFILL_TOKENS + 64)
    prefill = client.inference(peer, uids, max_length=PREFILL_TOKENS + 64)
    decode.step(torch.randn(1, 8, HIDDEN))
    prefill.step(torch.randn(1, 8, HIDDEN))  # both streams open and warm

    prefill_seconds: list[float] = []

    def run_prefill() -> None:
        started = time.perf_counter()
        prefill.step(torch.randn(1, PREFILL_TOKENS, HIDDEN))
        prefill_seconds.append(time.perf_counter() - started)

    thread = threading.Thread(target=run_prefill)
    thread.start()
    latencies = []
    while thread.is_alive():
        started = time.perf_counter()
        decode.step(torch.randn(1, 1, HIDDEN))
        latencies.append(time.perf_counter() - started)
    thread.join()
    (prefill_time,) = prefill_seconds
    assert len(latencies) >= 3, f"only {len(latencies)} decode steps during a {prefill_time:.2f} s prefill"
    assert max(latencies) < prefill_time / 3, (
        f"a decode step waited {max(latencies):.3f} s during a {prefill_time:.3f} s prefill"
    )
    decode.close()
    prefill.close()
