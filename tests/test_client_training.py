"""Gradients through the swarm: input gradients, prompt tuning and a local classification head."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT


@pytest.fixture
def swarm(tiny_llama_swarm):
    return tiny_llama_swarm


def load(auto_class, swarm, **overrides):
    path, initial_peers = swarm
    return auto_class.from_pretrained(path, initial_peers=initial_peers, **LOOPBACK_CLIENT, **overrides)


def token_ids(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(3))


def test_input_gradients_match_local_autograd(swarm):
    remote = load(petals.AutoDistributedModelForCausalLM, swarm)
    local = AutoModelForCausalLM.from_pretrained(swarm[0], dtype=torch.float32)
    ids = token_ids()
    grads = []
    for model in (remote, local):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        grads.append(embeds.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tuning_mode", ["ptune", "deep_ptune"])
def test_prompt_tuning_reduces_the_loss(swarm, tuning_mode):
    model = load(petals.AutoDistributedModelForCausalLM, swarm, tuning_mode=tuning_mode, pre_seq_len=3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in model._prompt_parameters()}
    optimizer = torch.optim.Adam(trainable, lr=0.05)
    ids = token_ids()
    losses = []
    for _ in range(20):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_sequence_classification_trains_a_local_head(swarm):
    model = load(petals.AutoDistributedModelForSequenceClassification, swarm, num_labels=2, pad_token_id=0)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["score.weight"]
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids, labels = token_ids(batch=4), torch.tensor([0, 1, 0, 1])
    losses = []
    for _ in range(10):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_the_base_model_class_runs_its_blocks_remotely(swarm):
    """``AutoDistributedModel`` (no head): its layer list sits at ``block_prefix`` less the base prefix."""
    from transformers import AutoModel

    remote = load(petals.AutoDistributedModel, swarm)
    local = AutoModel.from_pretrained(swarm[0], dtype=torch.float32)
    ids = token_ids()
    with torch.no_grad():
        expected = local(ids).last_hidden_state
        torch.testing.assert_close(remote(ids).last_hidden_state, expected, atol=1e-4, rtol=1e-4)
    assert len(remote.remote_blocks) == local.config.num_hidden_layers
    remote.close()
