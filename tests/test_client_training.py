"""Gradients through the swarm: input gradients, prompt tuning and a local classification head."""

from __future__ import annotations

from pathlib import Path

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


def input_gradients(model) -> torch.Tensor:
    embeds = model.get_input_embeddings()(token_ids()).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return embeds.grad


def test_input_gradients_match_local_autograd(swarm):
    remote = load(petals.AutoDistributedModelForCausalLM, swarm)
    local = AutoModelForCausalLM.from_pretrained(swarm[0], dtype=torch.float32)
    assert torch.allclose(input_gradients(remote), input_gradients(local), atol=1e-4, rtol=1e-4)


def test_a_server_keeping_no_graphs_recomputes_every_block_to_the_same_gradients(tiny_model_path):
    """``--backward_graph_budget 0``: each block runs forward again inside its backward task, as in Petals."""
    from petals.testing.swarm import inprocess_swarm

    path = tiny_model_path("llama")
    with inprocess_swarm(path, "0:4", server_args=("--backward_graph_budget", "0")) as (dht, (server,)):
        engine = server.server.span.engine
        assert engine.graphs.limit == 0
        remote = load(petals.AutoDistributedModelForCausalLM, (path, dht.initial_peers))
        try:
            grads = input_gradients(remote)
        finally:
            remote.close()
        assert engine.graphs.used == 0
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.allclose(grads, input_gradients(local), atol=1e-4, rtol=1e-4)


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


def test_the_readme_training_loop_runs_as_written(swarm, tmp_path, monkeypatch):
    """README "Fine-tune", "Your own training loop": its code, run against a swarm, trains and saves
    prompts that a second model loads (only the model's name, the peers and the batches are filled in)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.partition("**Your own training loop**")[2]
    code = section.partition("```python\n")[2].partition("```")[0]
    assert code.count('"path/or/org-name"') == 2 and code.count("initial_peers=[...]") == 2, code
    code = code.replace('"path/or/org-name"', "MODEL").replace(
        "initial_peers=[...]", "initial_peers=PEERS, **LOOPBACK_CLIENT"
    )
    ids = token_ids(batch=2, length=6)
    labels = ids.clone()
    labels[:, :2] = -100  # no loss on a "prompt" part, as petals tune does
    namespace = {
        "MODEL": str(swarm[0]),
        "PEERS": swarm[1],
        "LOOPBACK_CLIENT": LOOPBACK_CLIENT,
        "batches": [(ids, labels)] * 3,
    }
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(code, "README.md (Your own training loop)", "exec"), namespace)
        model, tuned = namespace["model"], namespace["tuned"]
        assert (tmp_path / "prompts.safetensors").is_file()
        trained = [p.detach().clone() for p in model._prompt_parameters()]
        assert trained and any(
            p.grad is not None and p.grad.abs().sum() > 0 for p in model._prompt_parameters()
        )
        for mine, loaded in zip(trained, tuned._prompt_parameters(), strict=True):
            torch.testing.assert_close(loaded.detach(), mine, rtol=0, atol=0)
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, tuned(input_ids=ids).logits, atol=1e-5)
    finally:
        for name in ("model", "tuned"):  # whatever the README's code got to build
            if name in namespace:
                namespace[name].close()
