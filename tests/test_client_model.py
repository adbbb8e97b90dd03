"""The distributed causal LM computes exactly what the local transformers model computes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT, inprocess_swarm

FAMILIES = ["llama", "bloom", "falcon-new", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def models(request, tiny_model_path):
    """(distributed model over a two-server swarm, local transformers model) of one family."""
    path = tiny_model_path(request.param)
    with inprocess_swarm(path, "0:2", "2:4") as (dht, _):
        remote = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        yield remote, local
        remote.remote_blocks.network.close()


def prompt(batch: int = 1, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_loads_only_local_tensors(models):
    remote, _ = models
    names = [name for name, _ in remote.named_parameters()]
    assert names and not any(".0." in name or ".1." in name for name in names), names
    assert len(remote.remote_blocks) == remote.config.num_hidden_layers
    # built from a plain transformers copy of the config, then every module got the model's own
    assert all(module.config is remote.config for module in remote.modules() if hasattr(module, "config"))
    assert not any(buffer.is_meta for buffer in remote.buffers())


def test_logits_match_local(models):
    remote, local = models
    ids = prompt(batch=2, length=9)
    with torch.no_grad():
        assert torch.allclose(remote(ids).logits, local(ids).logits, atol=1e-4, rtol=0)


def test_greedy_generate_matches_local(models):
    remote, local = models
    ids = prompt()
    kwargs = dict(max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert torch.equal(remote.generate(ids, **kwargs), local.generate(ids, **kwargs))


def test_seeded_sampling_matches_local(models):
    remote, local = models
    ids = prompt(batch=2)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=True, temperature=0.9, top_k=50)
    torch.manual_seed(0)
    expected = local.generate(ids, **kwargs)
    torch.manual_seed(0)
    assert torch.equal(remote.generate(ids, **kwargs), expected)


def test_beam_search_matches_local(models):
    remote, local = models
    ids = prompt(length=5)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, num_beams=2, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(remote.generate(ids, **kwargs), local.generate(ids, **kwargs))


def test_generate_calls_continue_one_session(models):
    remote, local = models
    ids = prompt()
    expected = local.generate(
        ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, repetition_penalty=1.2
    )
    with remote.inference_session(max_length=32) as session:
        first = remote.generate(
            ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, repetition_penalty=1.2
        )
        second = remote.generate(
            None, max_new_tokens=6, min_new_tokens=6, do_sample=False, repetition_penalty=1.2
        )
        assert session.position == expected.shape[1] - 1
    assert torch.equal(torch.cat([first, second], dim=1), expected)


def test_inference_session_steps_match_forward(models):
    remote, local = models
    ids = prompt(batch=2, length=8)
    with torch.no_grad():
        expected = local(ids).logits
        with remote.inference_session(max_length=8):
            steps = [remote(ids[:, :5]).logits, remote(ids[:, 5:6]).logits, remote(ids[:, 6:]).logits]
    assert torch.allclose(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)


def test_attention_mask_all_ones_is_accepted_and_padding_refused(models):
    remote, local = models
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    out = remote.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert torch.equal(
        out, local.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    )
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded"):
        remote.generate(ids, attention_mask=mask, max_new_tokens=3)


def test_a_family_config_adjusts_the_client_model_core_built():
    """``DistributedConfigMixin.adjust_client_model``: called once on the built model, its layers already
    remote (Gemma 4 corrects an index its model derived from a layer count of 0)."""
    from transformers import LlamaConfig

    from petals.client.model import AutoDistributedModelForCausalLM, distributed_class
    from petals.plugins import get_plugin_manager

    seen = []

    class Adjusting(get_plugin_manager().family("llama").config_class):
        def adjust_client_model(self, model) -> None:
            seen.append((type(model.model.layers[0]).__name__, len(model.remote_blocks)))

    config = Adjusting.from_dict(
        LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, vocab_size=100
        ).to_dict()
    )
    distributed_class(config, AutoDistributedModelForCausalLM)(config, network=object())
    assert seen == [("_RemoteLayers", 4)]
