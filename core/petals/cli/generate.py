"""``petals generate MODEL --initial_peers ... "prompt"``: stream a completion from any swarm.

What it is doing (loading the tokenizer and local weights, joining, routing) goes to stderr, so
that stdout holds only the generated text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from petals.cli.errors import PetalsCommand, configure_logging
from petals.cli.options import (
    PRIVATE_SWARM_OPTIONS,
    TOKENIZER_OPTION,
    VERIFY_OPTION,
    private_swarm_option_list,
)
from petals.patches import without_torch_distributed

PROMPT_LOOKUP_TOKENS = 10  # proposals per step: a wide-area round trip costs far more than verifying them


def client_options(command: Callable) -> Callable:
    """The options shared by ``petals generate`` and ``petals chat``: where the swarm is, how to sample."""
    options = [
        click.option(
            "--initial_peers",
            "--initial-peers",
            multiple=True,
            required=True,
            help="Multiaddr of a swarm peer.",
        ),
        click.option(
            "--dht_prefix", "--dht-prefix", default=None, help="DHT prefix of the model (default: derived)."
        ),
        click.option("--max_new_tokens", "--max-new-tokens", default=64, show_default=True),
        click.option("--temperature", default=0.0, show_default=True, help="0 means greedy decoding."),
        click.option("--top_p", "--top-p", default=1.0, show_default=True),
        click.option("--seed", default=None, type=int, help="Seed for sampling."),
        click.option(
            "--loopback", is_flag=True, help="Listen on 127.0.0.1 only, no NAT traversal or relays."
        ),
        TOKENIZER_OPTION,
        VERIFY_OPTION,
        click.option(
            "--prompts",
            default=None,
            type=click.Path(dir_okay=False),
            help="Trained prompts (a file written by `petals tune`) to put before every input.",
        ),
        *private_swarm_option_list(identity=True),
    ]
    for decorate in reversed(options):
        command = decorate(command)
    return command


@click.command("generate", cls=PetalsCommand)
@click.argument("model")
@click.argument("prompt")
@client_options
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the model's chat template.")
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
    model: str, prompt: str, chat: bool, speculative: str | None, assistant: str | None, **options: Any
) -> None:
    """Generate text with MODEL's blocks served by a swarm, streaming tokens as they come."""
    without_torch_distributed()  # before anything imports transformers' loading code
    from transformers import TextStreamer

    from petals.client.generation import StepStats

    configure_logging()
    speculation = speculation_kwargs(speculative, assistant)
    tokenizer, distributed = connect(model, options)
    try:
        inputs = encode(tokenizer, prompt, chat)
        prompt_length = inputs["input_ids"].shape[1]
        # prompt lookup may propose past max_new_tokens (transformers trims afterwards)
        max_length = (
            prompt_length + options["max_new_tokens"] + speculation.get("prompt_lookup_num_tokens", 0)
        )
        status("Routing through the swarm...")
        with distributed.inference_session(max_length=max_length) as session, StepStats(distributed) as stats:
            output = distributed.generate(
                **inputs,
                streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                **sampling_kwargs(options),
                **speculation,
            )
            status(f"Route: {describe_route(session.route)}")
        if speculation:
            status(stats.describe(prompt_length, output.shape[1] - prompt_length))
    finally:
        distributed.close()


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


def status(message: str) -> None:
    """What the command is doing, on stderr (stdout is for generated text)."""
    click.echo(message, err=True)


def connect(model: str, options: dict[str, Any], **overrides: Any):
    """The tokenizer and the distributed model, saying what happens while it joins the swarm
    (``options["prompts"]``: a prompts file; ``overrides``: config fields)."""
    from petals.cli.model_files import check_local_path, finding, load_tokenizer

    check_local_path(model)  # before the slow imports
    from petals import AutoDistributedModelForCausalLM

    status(f"Loading the tokenizer and the local layers of {model}...")
    tokenizer = load_tokenizer(model, options.get("tokenizer"))
    peers = list(options["initial_peers"])
    status(f"Joining the swarm through {len(peers)} initial peer(s)...")
    with finding(model):
        distributed = AutoDistributedModelForCausalLM.from_pretrained(
            model,
            initial_peers=peers,
            dht_prefix=options["dht_prefix"],
            verify=options.get("verify", 0.0),
            prompts=options.get("prompts"),
            loopback=options["loopback"],
            **{name: options[name] for name in PRIVATE_SWARM_OPTIONS},
            **overrides,
        )
    return tokenizer, distributed


def sampling_kwargs(options: dict[str, Any]) -> dict:
    import torch

    if options["seed"] is not None:
        torch.manual_seed(options["seed"])
    kwargs = {"max_new_tokens": options["max_new_tokens"]}
    if options["temperature"] > 0:
        kwargs.update(do_sample=True, temperature=options["temperature"], top_p=options["top_p"])
    return kwargs


def describe_route(route) -> str:
    return (
        ", ".join(f"blocks {span.start}:{span.end} on ...{str(span.peer_id)[-8:]}" for span in route) or "-"
    )


def encode(tokenizer, prompt: str, chat: bool) -> dict:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return dict(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        )
    return dict(tokenizer(prompt, return_tensors="pt"))
