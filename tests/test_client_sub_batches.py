"""Big batches through a server with a small --max_batch_size: the client splits them (as Petals)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT, inprocess_swarm
from petals.client.sequential_autograd import MAX_TOKENS_IN_BATCH

BATCH, LENGTH = 40, 32  # 1280 tokens: more than the server takes in one request


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    path = tiny_model_path("llama")
    server_args = ("--max_batch_size", str(MAX_TOKENS_IN_BATCH))
    with inprocess_swarm(path, "0:4", server_args=server_args) as (dht, _):
        yield path, dht.initial_peers


def load(swarm, **overrides):
    path, initial_peers = swarm
    return petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=initial_peers, **LOOPBACK_CLIENT, **overrides
    )


def token_ids(batch: int = BATCH) -> torch.Tensor:
    return torch.randint(3, 1000, (batch, LENGTH), generator=torch.Generator().manual_seed(4))


def test_a_batch_over_max_batch_size_matches_local_forward_and_backward(swarm):
    assert BATCH * LENGTH > MAX_TOKENS_IN_BATCH
    remote = load(swarm)
    local = AutoModelForCausalLM.from_pretrained(swarm[0], dtype=torch.float32)
    results = []
    for model in (remote, local):
        embeds = model.get_input_embeddings()(token_ids()).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        results.append((logits.detach(), embeds.grad))
    (remote_logits, remote_grad), (local_logits, local_grad) = results
    assert torch.allclose(remote_logits, local_logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(remote_grad, local_grad, atol=1e-4, rtol=1e-4)
    remote.close()


def test_deep_prompt_gradients_add_up_over_sub_batches(swarm):
    model = load(swarm, tuning_mode="deep_ptune", pre_seq_len=2)
    with torch.no_grad():
        model.intermediate_prompt_embeddings.weight.normal_(generator=torch.Generator().manual_seed(1))
    ids = token_ids()

    def prompt_grad(rows: slice) -> torch.Tensor:
        model.zero_grad()
        model(input_ids=ids[rows], labels=ids[rows]).loss.backward()
        return model.intermediate_prompt_embeddings.weight.grad.clone()

    whole = prompt_grad(slice(None)) * BATCH  # the loss is a mean over rows (of equal length)
    halves = prompt_grad(slice(0, BATCH // 2)) * (BATCH // 2) + prompt_grad(slice(BATCH // 2, None)) * (
        BATCH // 2
    )
    assert torch.allclose(whole, halves, atol=1e-4, rtol=1e-3)
    model.close()
