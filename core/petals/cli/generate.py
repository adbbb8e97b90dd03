"""``petals generate MODEL --initial_peers ... "prompt"``: stream a completion from any swarm."""

from __future__ import annotations

import click

# what a client passes to stay on this machine: listen on 127.0.0.1 only, no NAT traversal or relays
LOOPBACK_CLIENT = {
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
    "use_relay": False,
}
PROMPT_LOOKUP_TOKENS = 10  # proposals per step: a wide-area round trip costs far more than verifying them


@click.command("generate")
@click.argument("model")
@click.argument("prompt")
@click.option(
    "--initial_peers", "--initial-peers", multiple=True, required=True, help="Multiaddr of a swarm peer."
)
@click.option(
    "--dht_prefix", "--dht-prefix", default=None, help="DHT prefix of the model (default: derived)."
)
@click.option("--max_new_tokens", "--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 means greedy decoding.")
@click.option("--top_p", "--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int, help="Seed for sampling.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the model's chat template.")
@click.option("--loopback", is_flag=True, help="Listen on 127.0.0.1 only, no NAT traversal or relays.")
@click.option(
    "--speculative",
    default=None,
    metavar="prompt-lookup[:K]",
    help=f"Propose up to K tokens (default {PROMPT_LOOKUP_TOKENS}) found in the text so far; the swarm "
    "verifies them in one step.",
)
@click.option(
    "--assistant",
    default=None,
    metavar="MODEL",
    help="A small local model with the same tokenizer that drafts tokens for the swarm to verify.",
)
def generate_command(
    model,
    prompt,
    initial_peers,
    dht_prefix,
    max_new_tokens,
    temperature,
    top_p,
    seed,
    chat,
    loopback,
    speculative,
    assistant,
):
    """Generate text with MODEL's blocks served by a swarm, streaming tokens as they come."""
    import torch
    from transformers import AutoTokenizer, TextStreamer

    from petals import AutoDistributedModelForCausalLM
    from petals.client.generation import StepStats
    from petals.testing.swarm import LOOPBACK_CLIENT

    speculation = speculation_kwargs(speculative, assistant)
    tokenizer = AutoTokenizer.from_pretrained(model)
    network_options = LOOPBACK_CLIENT if loopback else {}
    distributed = AutoDistributedModelForCausalLM.from_pretrained(
        model, initial_peers=list(initial_peers), dht_prefix=dht_prefix, **network_options
    )
    try:
        inputs = encode(tokenizer, prompt, chat)
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else {}
        with StepStats(distributed) as stats:
            output = distributed.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                **sampling,
                **speculation,
            )
        if speculation:
            prompt_length = inputs["input_ids"].shape[1]
            click.echo(stats.describe(prompt_length, output.shape[1] - prompt_length), err=True)
    finally:
        distributed.remote_blocks.network.close()


def speculation_kwargs(speculative: str | None, assistant: str | None) -> dict:
    """``generate`` arguments for ``--speculative prompt-lookup[:K]`` or ``--assistant MODEL``."""
    if speculative and assistant:
        raise click.UsageError("use either --speculative or --assistant, not both")
    if assistant:
        from transformers import AutoModelForCausalLM

        return {"assistant_model": AutoModelForCausalLM.from_pretrained(assistant).eval()}
    if not speculative:
        return {}
    method, _, tokens = speculative.partition(":")
    if method != "prompt-lookup" or (tokens and not (tokens.isdigit() and int(tokens) > 0)):
        raise click.BadParameter(
            f"expected prompt-lookup or prompt-lookup:K with K >= 1, got {speculative!r}",
            param_hint="--speculative",
        )
    return {"prompt_lookup_num_tokens": int(tokens) if tokens else PROMPT_LOOKUP_TOKENS}


def encode(tokenizer, prompt: str, chat: bool) -> dict:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return dict(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        )
    return dict(tokenizer(prompt, return_tensors="pt"))
