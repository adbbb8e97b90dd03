"""`petals chat` in a pseudo-terminal and `petals generate`'s progress, against a real SmolLM2 swarm."""

from __future__ import annotations

import os
import subprocess
import sys

import pexpect
import pytest
import torch
from transformers import AutoTokenizer

from conftest import imported_modules
from petals.cli.chat import PROMPT
from petals.demo_model import prepare_demo_model
from petals.formats.gguf import local_model
from petals.testing.swarm import inprocess_swarm

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 20
MAX_LENGTH = 256
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And which river flows through it?"


@pytest.fixture(scope="module")
def smol_swarm():
    path = prepare_demo_model()
    with inprocess_swarm(path, "0:18", "18:30") as (dht, _):
        yield path, dht.initial_peers[0]


@pytest.fixture(scope="module")
def local_reply(smol_swarm):
    """What plain transformers answers (greedy) to a conversation."""
    path, _ = smol_swarm
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = local_model(path, dtype=torch.float32)

    def reply(messages: list[dict]) -> str:
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()

    return reply


def say(chat: pexpect.spawn, message: str) -> str:
    """Send one line, return what the chat printed before its next prompt (without the echoed line)."""
    chat.sendline(message)
    chat.expect_exact(PROMPT)
    printed = chat.before.replace("\r\n", "\n")
    return printed.split("\n", 1)[1].strip() if "\n" in printed else ""


def test_chat_keeps_one_conversation_resets_and_says_when_it_is_full(smol_swarm, local_reply):
    path, peer = smol_swarm
    chat = pexpect.spawn(
        sys.executable,
        ["-m", "petals.cli", "chat", str(path), "--initial_peers", peer, "--loopback"]
        + ["--max_new_tokens", str(MAX_NEW_TOKENS), "--max_length", str(MAX_LENGTH)],
        encoding="utf-8",
        timeout=180,
        env={**os.environ, "PETALS_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"},
        dimensions=(50, 400),
    )
    try:
        chat.expect_exact(PROMPT)
        first = say(chat, QUESTION)
        assert "Paris" in first and first == local_reply([{"role": "user", "content": QUESTION}])
        second = say(chat, FOLLOW_UP)
        history = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first},
            {"role": "user", "content": FOLLOW_UP},
        ]
        assert second == local_reply(history)  # the servers' caches kept the first turn
        assert "New conversation" in say(chat, "/reset")
        assert say(chat, QUESTION) == first
        assert "reached --max_length (256 tokens)" in say(chat, "word " * MAX_LENGTH)
        assert "reached --max_length" in say(chat, "Still there?")  # full until /reset
        say(chat, "/reset")
        assert say(chat, QUESTION) == first
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0


def test_generate_says_what_it_does_while_connecting_and_routing_and_imports_no_unused_parts(smol_swarm):
    """Also: its client never creates a process group, so petals' commands keep transformers' loading code
    from importing DTensor and FSDP (``petals.patches.without_torch_distributed``), and the client builds its
    local parts on the meta device without torch's Python reference ops, whose first use imports sympy."""
    path, peer = smol_swarm
    result = subprocess.run(
        [sys.executable, "-m", "petals.cli", "generate", str(path), "--initial_peers", peer, "--loopback"]
        + ["--chat", "--max_new_tokens", "8", QUESTION],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = imported_modules(result.stderr.splitlines())
    assert {"torch", "transformers.modeling_utils", "petals.client.inference_session"} <= imported
    assert not imported & {"torch.distributed.tensor", "torch.distributed.fsdp", "sympy"}
    steps = ["Loading the tokenizer", "Joining the swarm through 1 initial peer", "Routing through the swarm"]
    positions = [result.stderr.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), result.stderr
    assert "Route: blocks 0:18 on ..." in result.stderr and "blocks 18:30 on ..." in result.stderr
    assert "Paris" in result.stdout
