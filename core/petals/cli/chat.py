"""``petals chat MODEL --initial_peers ...``: an interactive conversation with a model served by a swarm.

The whole conversation is one inference session: the servers keep the KV cache of every turn, so
each turn sends only its new tokens (the next user message in the tokenizer's chat template) and
the reply streams back token by token. ``/reset`` starts a new conversation (a new session),
``/exit`` or end of input (Ctrl-D) leaves. When the conversation would outgrow ``--max_length``
tokens, the chat says so and waits for ``/reset``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import click

from petals.cli.errors import PetalsCommand, configure_logging
from petals.cli.generate import client_options, connect, sampling_kwargs, status
from petals.patches import without_torch_distributed

PROMPT = "You: "
FULL_MESSAGE = (
    "[The conversation has reached --max_length ({max_length} tokens). "
    "Type /reset to start a new one, or restart with a larger --max_length.]"
)


class Conversation:
    """The messages so far and the inference session that has seen them."""

    def __init__(self, tokenizer, model, max_length: int, system: str | None) -> None:
        self.tokenizer, self.model, self.max_length = tokenizer, model, max_length
        self.start = [{"role": "system", "content": system}] if system else []
        self._open()

    def _open(self) -> None:
        self.messages = list(self.start)
        self._session = contextlib.ExitStack()
        self.session = self._session.enter_context(self.model.inference_session(max_length=self.max_length))

    def close(self) -> None:
        self._session.close()

    def reset(self) -> None:
        self.close()
        self._open()

    def new_tokens(self, user_message: str):
        """The tokens this turn adds: the chat template's rendering beyond what the session has seen."""
        messages = [*self.messages, {"role": "user", "content": user_message}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        seen = self.session.output_ids
        seen_text = self.tokenizer.decode(seen[0]) if seen is not None else ""
        suffix = text[len(os.path.commonprefix([seen_text, text])) :]
        return self.tokenizer(suffix, add_special_tokens=False, return_tensors="pt").input_ids

    def seen_length(self) -> int:
        seen = self.session.output_ids
        return seen.shape[1] if seen is not None else 0

    def turn(self, user_message: str, streamer, sampling: dict[str, Any]) -> bool:
        """Answer one message, streaming the reply; False if the conversation is (now) full."""
        new_ids = self.new_tokens(user_message)
        room = self.max_length - self.seen_length() - new_ids.shape[1]
        if room < 1:
            return False
        before = self.seen_length() + new_ids.shape[1]
        max_new_tokens = min(sampling["max_new_tokens"], room)
        self.model.generate(new_ids, streamer=streamer, **{**sampling, "max_new_tokens": max_new_tokens})
        reply = self.tokenizer.decode(self.session.output_ids[0, before:], skip_special_tokens=True)
        self.messages += [{"role": "user", "content": user_message}, {"role": "assistant", "content": reply}]
        return self.seen_length() < self.max_length


@click.command("chat", cls=PetalsCommand)
@click.argument("model")
@client_options
@click.option(
    "--max_length", "--max-length", default=2048, show_default=True, help="Tokens the conversation may hold."
)
@click.option("--system", default=None, help="A system message that starts every conversation.")
def chat_command(model: str, max_length: int, system: str | None, **options: Any) -> None:
    """Chat with MODEL served by a swarm: one inference session, /reset for a new conversation, /exit to leave."""
    without_torch_distributed()  # before anything imports transformers' loading code
    from transformers import TextStreamer

    configure_logging()
    tokenizer, distributed = connect(model, options)
    if tokenizer.chat_template is None:
        distributed.close()
        raise click.UsageError(f"{model}'s tokenizer has no chat template; use `petals generate` instead")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    sampling = sampling_kwargs(options)
    conversation = Conversation(tokenizer, distributed, max_length, system)
    status("Connected. Type a message; /reset starts a new conversation, /exit leaves.")
    try:
        chat_loop(conversation, streamer, sampling)
    finally:
        conversation.close()
        distributed.close()


def chat_loop(conversation: Conversation, streamer, sampling: dict[str, Any]) -> None:
    full = False
    while True:
        try:
            line = input(PROMPT).strip()
        except EOFError:
            click.echo()
            return
        if line == "/exit":
            return
        if line == "/reset":
            conversation.reset()
            full = False
            click.echo("[New conversation.]")
            continue
        if not line:
            continue
        full = full or not conversation.turn(line, streamer, sampling)
        if full:
            click.echo(FULL_MESSAGE.format(max_length=conversation.max_length))
