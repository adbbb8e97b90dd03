"""``petals tune MODEL --initial_peers ... --data FILE.jsonl --out PROMPTS.safetensors``: prompt tuning
through a swarm.

Each line of the data file is ``{"prompt": ..., "completion": ...}``; the loss counts only the
completion's tokens (and the end-of-sequence token after it). Rows of a batch are padded on the
right, where a causal model's earlier positions never see the padding. Only the prompts train
(``--mode ptune``: before the input; ``deep_ptune``: also before every block's input), with Adam.
A step that fails (the swarm lost every server of some blocks for a while) is retried with the
same batch, so a fault costs a retried step, never a different run. Ctrl-C ends the step under
way and saves what was trained so far; a second Ctrl-C stops at once, and saves too.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from petals.cli.errors import PetalsCommand, configure_logging
from petals.cli.generate import connect, encode, status
from petals.cli.options import TOKENIZER_OPTION, option, private_swarm_options
from petals.patches import without_torch_distributed

STEP_ATTEMPTS = 3
EXISTING_FILE = click.Path(exists=True, dir_okay=False)


@dataclass
class Example:
    prompt: str
    completion: str
    input_ids: list[int]
    labels: list[int]  # -100 on the prompt's tokens


@dataclass
class Metrics:
    model: str
    mode: str
    pre_seq_len: int
    steps: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    retried_steps: list[int] = field(default_factory=list)
    interrupted: bool = False

    def write(self, path: str | None) -> None:
        if path is not None:
            Path(path).write_text(json.dumps(vars(self), indent=1) + "\n")


def read_rows(path: str) -> list[dict[str, str]]:
    """The ``{"prompt", "completion"}`` rows of a JSONL file; a bad line fails naming its number."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise click.BadParameter(f"{path} line {number} is not JSON: {error}") from error
        if not (
            isinstance(row, dict) and all(isinstance(row.get(key), str) for key in ("prompt", "completion"))
        ):
            raise click.BadParameter(
                f'{path} line {number}: expected {{"prompt": "...", "completion": "..."}}'
            )
        rows.append({"prompt": row["prompt"], "completion": row["completion"]})
    if not rows:
        raise click.BadParameter(f"{path} holds no rows")
    return rows


def make_example(tokenizer, row: dict[str, str], chat: bool) -> Example:
    prompt_ids = encode(tokenizer, row["prompt"], chat)["input_ids"][0].tolist()
    completion_ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        completion_ids = [*completion_ids, tokenizer.eos_token_id]
    return Example(
        row["prompt"],
        row["completion"],
        prompt_ids + completion_ids,
        [-100] * len(prompt_ids) + completion_ids,
    )


def batch_tensors(examples: list[Example], pad_id: int):
    import torch

    length = max(len(example.input_ids) for example in examples)
    ids = [example.input_ids + [pad_id] * (length - len(example.input_ids)) for example in examples]
    labels = [example.labels + [-100] * (length - len(example.labels)) for example in examples]
    return torch.tensor(ids), torch.tensor(labels)


def batch_order(count: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Which examples each step trains on: seeded shuffles of the data, one epoch after another."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch_size:
        order += torch.randperm(count, generator=generator).tolist()
    return [order[step * batch_size : (step + 1) * batch_size] for step in range(steps)]


def init_from_vocabulary(model, seed: int) -> None:
    """Start the input prompts as the embeddings of random vocabulary tokens: at the scale the first
    block expects, unlike ``nn.Embedding``'s N(0, 1) (deep prompts start at zero)."""
    import torch

    embeddings = model.get_input_embeddings().weight
    rows = torch.randint(
        0, embeddings.shape[0], (model.config.pre_seq_len,), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        model.prompt_embeddings.weight.copy_(embeddings[rows])


def loss_of(model, examples: list[Example], pad_id: int):
    ids, labels = batch_tensors(examples, pad_id)
    return model(input_ids=ids, labels=labels).loss


def train_step(model, optimizer, examples: list[Example], pad_id: int, metrics: Metrics, step: int) -> float:
    """One optimizer step; a failed attempt is retried with the same batch (and says so)."""
    for attempt in range(STEP_ATTEMPTS):
        optimizer.zero_grad()
        try:
            loss = loss_of(model, examples, pad_id)
            loss.backward()
            break
        except Exception as error:
            if attempt == STEP_ATTEMPTS - 1 or isinstance(error, (ValueError, TypeError)):
                raise
            metrics.retried_steps.append(step)
            status(f"step {step} failed ({type(error).__name__}: {error}); retrying it")
    optimizer.step()
    return loss.item()


def evaluate(model, tokenizer, examples: list[Example], pad_id: int, chat: bool) -> dict[str, Any]:
    """Mean loss and greedy exact match (the completion, stripped) over ``examples``, one at a time."""
    import torch

    losses, answers = [], []
    with torch.no_grad():
        for example in examples:
            losses.append(loss_of(model, [example], pad_id).item())
            answers.append(answer(model, tokenizer, example, chat))
    matches = sum(
        got.strip() == example.completion.strip() for got, example in zip(answers, examples, strict=True)
    )
    return {
        "loss": sum(losses) / len(losses),
        "exact_match": matches / len(examples),
        "matches": matches,
        "examples": len(examples),
        "answers": answers,
    }


def answer(model, tokenizer, example: Example, chat: bool, extra_tokens: int = 4) -> str:
    """The model's greedy completion of ``example.prompt``, as long as the expected one and a bit."""
    inputs = encode(tokenizer, example.prompt, chat)
    new_tokens = sum(label != -100 for label in example.labels) + extra_tokens
    output = model.generate(
        **inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def eval_line(step: int, result: dict[str, Any]) -> str:
    return (
        f"eval after step {step}: loss {result['loss']:.4f}, exact match {result['matches']}/{result['examples']} "
        f"({100 * result['exact_match']:.0f}%)"
    )


@dataclass
class TuneRun:
    """What one ``petals tune`` trains on and with."""

    model: Any
    tokenizer: Any
    train: list[Example]
    held_out: list[Example]
    steps: int
    lr: float
    batch_size: int
    eval_every: int
    seed: int
    chat: bool
    on_step: Callable[[int], None] | None = None  # called after each step with its number

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def run(self, metrics: Metrics, stop: threading.Event | None = None) -> None:
        """Train for ``steps`` (evaluating before, every ``eval_every`` steps and at the end), or until
        ``stop`` is set: then the step under way ends first."""
        import torch
        from tqdm import tqdm

        trainable = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        optimizer = torch.optim.Adam(trainable, lr=self.lr)
        self.evaluate(0, metrics)
        progress = tqdm(
            batch_order(len(self.train), self.batch_size, self.steps, self.seed), desc="tune", unit="step"
        )
        for step, indices in enumerate(progress, start=1):
            if stop is not None and stop.is_set():
                break
            started = time.perf_counter()
            examples = [self.train[index] for index in indices]
            loss = train_step(self.model, optimizer, examples, self.pad_id, metrics, step)
            seconds = time.perf_counter() - started
            tokens = sum(len(example.input_ids) for example in examples)
            metrics.steps.append({"step": step, "loss": loss, "tokens": tokens, "seconds": seconds})
            progress.set_postfix_str(f"loss {loss:.4f}, {tokens / seconds:.0f} tokens/s")
            if not math.isfinite(loss):
                raise click.ClickException(f"the loss became {loss} at step {step}: lower --lr")
            if self.on_step is not None:
                self.on_step(step)
            if step == self.steps or (self.eval_every and step % self.eval_every == 0):
                progress.clear()
                self.evaluate(step, metrics)
        progress.close()

    def evaluate(self, step: int, metrics: Metrics) -> None:
        if not self.held_out or (metrics.evals and metrics.evals[-1]["step"] == step):
            return
        result = evaluate(self.model, self.tokenizer, self.held_out, self.pad_id, self.chat)
        metrics.evals.append({"step": step, **result})
        click.echo(eval_line(step, result), err=True)


@contextlib.contextmanager
def stopped_by_ctrl_c(stop: threading.Event) -> Iterator[None]:
    """Within the block, the first Ctrl-C sets ``stop`` and the second raises ``KeyboardInterrupt``.

    A flag, not an exception: Python runs a signal's handler between any two bytecodes of the main
    thread, and an exception raised there can be lost (inside a finalizer, ``__del__`` or a weakref
    callback, it is printed as ignored). CI saw a Ctrl-C lost so: the tune trained on for 60 s, its
    main thread in the next step's backward; where the exception went was not caught."""

    def on_ctrl_c(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@click.command("tune", cls=PetalsCommand)
@click.argument("model")
@option("--initial_peers", multiple=True, required=True, help="Multiaddr of a swarm peer.")
@option("--dht_prefix", default=None, help="DHT prefix of the model (default: derived).")
@option("--loopback", is_flag=True, help="Listen on 127.0.0.1 only, no NAT traversal or relays.")
@TOKENIZER_OPTION
@option("--data", required=True, type=EXISTING_FILE, help='JSONL of {"prompt": ..., "completion": ...} rows.')
@option("--eval", "eval_path", type=EXISTING_FILE, help="JSONL rows to evaluate on (loss, exact match).")
@option(
    "--mode",
    type=click.Choice(["deep_ptune", "ptune"]),
    default="deep_ptune",
    show_default=True,
    help="deep_ptune: prompts before every block's input; ptune: before the model's input only.",
)
@option("--pre_seq_len", default=16, show_default=True, type=click.IntRange(min=1), help="Prompt tokens.")
@option("--steps", default=100, show_default=True, type=click.IntRange(min=1), help="Optimizer steps.")
@option(
    "--lr", default=1e-2, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Adam's rate."
)
@option("--batch_size", default=8, show_default=True, type=click.IntRange(min=1), help="Rows per step.")
@option(
    "--eval_every",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Evaluate every N steps too (always before and after training).",
)
@option("--chat/--no-chat", default=False, help="Wrap each prompt in the model's chat template.")
@option(
    "--seed", default=0, show_default=True, help="Seed of the prompts' initial values and the data order."
)
@option(
    "--out", required=True, type=click.Path(dir_okay=False), help="Where to save the prompts (safetensors)."
)
@option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    help="Write every step's loss and the evaluations here.",
)
@option(
    "--request_timeout",
    default=180.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds before a silent server's request is retried elsewhere.",
)
@private_swarm_options
def tune_command(model: str, out: str, json_path: str | None, **options: Any) -> None:
    """Train prompts for MODEL through a swarm on prompt/completion rows and save them to --out."""
    without_torch_distributed()  # before anything imports transformers' loading code
    import torch

    configure_logging()
    train_rows = read_rows(options["data"])
    held_out_rows = read_rows(options["eval_path"]) if options["eval_path"] else []
    torch.manual_seed(options["seed"])
    tokenizer, distributed = connect(
        model,
        options,
        tuning_mode=options["mode"],
        pre_seq_len=options["pre_seq_len"],
        request_timeout=options["request_timeout"],
    )
    init_from_vocabulary(distributed, options["seed"])
    metrics = Metrics(model, options["mode"], options["pre_seq_len"])
    try:
        run = TuneRun(
            distributed,
            tokenizer,
            [make_example(tokenizer, row, options["chat"]) for row in train_rows],
            [make_example(tokenizer, row, options["chat"]) for row in held_out_rows],
            **{key: options[key] for key in ("steps", "lr", "batch_size", "eval_every", "seed", "chat")},
        )
        stop = threading.Event()
        try:
            with stopped_by_ctrl_c(stop):
                run.run(metrics, stop)
        except KeyboardInterrupt:  # a second Ctrl-C: at once
            stop.set()
        if stop.is_set():
            metrics.interrupted = True
            status(f"Interrupted after {len(metrics.steps)} step(s): saving what was trained so far")
        distributed.save_prompts(out)
        metrics.write(json_path)
        status(f"Saved {options['mode']} prompts ({options['pre_seq_len']} tokens) to {out}")
    finally:
        distributed.close()
    if metrics.interrupted:
        raise click.exceptions.Exit(130)
