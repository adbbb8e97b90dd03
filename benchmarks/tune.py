"""(t) A deep prompt tuning step through a local swarm vs the same step on local transformers.

    python -m benchmarks.tune [--quick]

One training step (zero the gradients, forward, backward, Adam) on [8, 64] tokens of SmolLM2-135M-
Instruct with 16 trainable deep prompts, its blocks served by 3 servers x 10 blocks, against the same
step on the transformers model with the same prompts added the same way (prepended to the input
embeddings; added to the first positions of every block's input, as the servers do), taking turns in
one process. Ratio = best swarm step / best local step. The prompts' gradients of both are compared
(max |difference| / max |local gradient|).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from benchmarks.harness import Check, Context, Result, against_local, main

BATCH, LENGTH, PRE_SEQ_LEN = 8, 64, 16
GOAL = 1.5
GRADIENT_GOAL = 1e-3


class LocalPrompts(nn.Module):
    """Deep prompts on a plain transformers causal LM, placed where the swarm's servers place them."""

    def __init__(self, model, pre_seq_len: int) -> None:
        super().__init__()
        self.model = model
        config = model.config
        self.prompt_embeddings = nn.Embedding(pre_seq_len, config.hidden_size)
        self.intermediate_prompt_embeddings = nn.Embedding(
            pre_seq_len, config.num_hidden_layers * config.hidden_size
        )
        self._deep: torch.Tensor | None = None
        self.hooks = [
            layer.register_forward_pre_hook(self._add_prompt(index), with_kwargs=True)
            for index, layer in enumerate(model.model.layers)
        ]

    def remove(self) -> None:
        """Leave the (shared) transformers model as it was."""
        for hook in self.hooks:
            hook.remove()
        for parameter in self.model.parameters():
            parameter.requires_grad_(True)

    def _add_prompt(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            prompt = self._deep[index]
            hidden = torch.cat([hidden[:, : prompt.shape[1]] + prompt, hidden[:, prompt.shape[1] :]], dim=1)
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

        return hook

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, pre = input_ids.shape[0], self.prompt_embeddings.num_embeddings
        weight = self.intermediate_prompt_embeddings.weight
        self._deep = weight.view(pre, self.model.config.num_hidden_layers, -1).permute(1, 0, 2).unsqueeze(1)
        prompts = self.prompt_embeddings.weight.unsqueeze(0).expand(batch, -1, -1)
        embeds = torch.cat([prompts, self.model.get_input_embeddings()(input_ids)], dim=1)
        # the swarm's client drops the prompts' logits: the first token is never predicted there either
        labels = torch.cat([torch.full((batch, pre + 1), -100), labels[:, 1:]], dim=1)
        return self.model(inputs_embeds=embeds, labels=labels, use_cache=False).loss


def tune_step(ctx: Context) -> Result:
    from petals import AutoDistributedModelForCausalLM
    from petals.testing.swarm import LOOPBACK_CLIENT

    repeats = ctx.pick(3, 1)
    swarm = ctx.swarm("smollm2", servers=3)
    base = ctx.local_model("smollm2")
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    torch.manual_seed(0)
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path,
        initial_peers=swarm.initial_peers,
        tuning_mode="deep_ptune",
        pre_seq_len=PRE_SEQ_LEN,
        **LOOPBACK_CLIENT,
    )
    swarm.clients.append(remote)
    local = LocalPrompts(base, PRE_SEQ_LEN)
    with torch.no_grad():  # the same (non-zero) prompts in both
        for name in ("prompt_embeddings", "intermediate_prompt_embeddings"):
            getattr(remote, name).weight.normal_(0, 0.05)
            getattr(local, name).weight.copy_(getattr(remote, name).weight)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, base.config.vocab_size, (BATCH, LENGTH), generator=generator)

    def step(model, optimizer, run) -> None:
        optimizer.zero_grad()
        run().backward()
        optimizer.step()

    try:
        difference = _gradient_difference(remote, local, input_ids)
        remote_optimizer = torch.optim.Adam([p for p in remote.parameters() if p.requires_grad], lr=0)
        local_optimizer = torch.optim.Adam(
            list(local.prompt_embeddings.parameters())
            + list(local.intermediate_prompt_embeddings.parameters()),
            lr=0,
        )
        seconds = against_local(
            lambda: step(local, local_optimizer, lambda: local(input_ids, input_ids)),
            lambda: step(
                remote, remote_optimizer, lambda: remote(input_ids=input_ids, labels=input_ids).loss
            ),
            repeats,
        )
    finally:
        local.remove()
    ratio = seconds["swarm"]["best"] / seconds["local"]["best"]
    return Result(
        item="t",
        title=f"deep prompt tuning step, 3 servers (smollm2), [{BATCH}, {LENGTH}] tokens",
        ratio=ratio,
        baseline="the same step on transformers with the same deep prompts, same process",
        checks=[
            Check("swarm / local training step time", ratio, GOAL, "<="),
            Check("prompt gradients: max relative difference", difference, GRADIENT_GOAL, "<=", unit=""),
        ],
        measurements={"seconds": seconds, "gradient_max_relative_difference": difference},
        settings={
            "model": "smollm2",
            "servers": 3,
            "batch": BATCH,
            "length": LENGTH,
            "pre_seq_len": PRE_SEQ_LEN,
        },
    )


def _gradient_difference(remote, local, input_ids: torch.Tensor) -> float:
    """max |swarm gradient - local gradient| / max |local gradient|, over both prompt tensors."""
    remote(input_ids=input_ids, labels=input_ids).loss.backward()
    local(input_ids, input_ids).backward()
    worst = 0.0
    for name in ("prompt_embeddings", "intermediate_prompt_embeddings"):
        ours, theirs = getattr(remote, name).weight.grad, getattr(local, name).weight.grad
        worst = max(worst, ((ours - theirs).abs().max() / theirs.abs().max()).item())
    return worst


BENCHMARKS = {"tune": tune_step}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
