"""Multimodal wrapper checkpoints generate exactly through real processes: a ``petals dht`` and two
``petals serve`` (blocks 0:2 and 2:4) serve a tiny random wrapper saved as transformers saves it, and the
distributed model's greedy tokens and logits equal those of transformers' own wrapper model on the same
files with a text-only prompt. Each wrapper switches on what its text model adds:

* gemma3 (text gemma3_text): sliding and full attention, a head tied to the embeddings, and a checkpoint
  in the older ``language_model.model.`` layout;
* qwen3_5 / qwen3_5_moe (text qwen3_5_text / qwen3_5_moe_text): gated delta net and full attention
  layers under ``model.language_model.``, experts stored one by one and fused as blocks load;
* mistral3 (text mistral): a head that only the wrapper's config ties;
* llama4 (text llama4_text): chunked attention and experts every other layer. Its reference is the text
  causal LM inside transformers' wrapper (with the wrapper's weights), because
  ``Llama4ForConditionalGeneration`` itself fails on a text-only prompt in transformers 5.24
  (``MoeCausalLMOutputWithPast`` has no ``image_outputs``).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForImageTextToText

import petals
from conftest import LOOPBACK_CLIENT, save_random_wrapper
from petals.testing.swarm import running_swarm

PROMPT = 6
NEW_TOKENS = 10  # past gemma3's sliding window and llama4's attention chunk
# what of transformers' wrapper model generates the reference (the whole wrapper unless named)
REFERENCE_MODULES = {"llama4": "language_model"}


def remembering(model: torch.nn.Module) -> None:
    """Gated delta net heads that keep the session's history (transformers' random decay forgets within
    a token)."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("A_log"):
                tensor.fill_(math.log(0.01))


@pytest.mark.slow
@pytest.mark.parametrize("wrapper_type", ["gemma3", "llama4", "qwen3_5", "qwen3_5_moe", "mistral3"])
def test_greedy_tokens_equal_transformers_wrapper(wrapper_type, tmp_path):
    path = save_random_wrapper(wrapper_type, tmp_path / wrapper_type, adjust=remembering)
    ids = torch.randint(3, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    wrapper = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    reference = wrapper.get_submodule(REFERENCE_MODULES.get(wrapper_type, ""))
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)

    with running_swarm(path, "0:2", "2:4") as (dht, _):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
        )
        output = model.generate(ids, **kwargs)
        model.close()
    assert torch.equal(output.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4
