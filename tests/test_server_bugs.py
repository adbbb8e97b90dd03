"""A server's own failure reaches the user: when its blocks raise on every step, the client stops
within seconds with the server's error and the blocks, instead of banning and waiting; a broken
server among healthy ones is still routed around.

The broken servers are real in-process servers whose hosted blocks raise before computing (a forward
pre-hook on every block module), as a block with a bug does; the server sends ``[internal] ...``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch

import petals
from conftest import LOOPBACK_CLIENT
from petals.client.routing import ServerFailure
from petals.server.throughput import ThroughputInfo
from petals.testing.inprocess import InProcessDht, InProcessServer

BUG = "RotaryEmbedding.forward() missing 1 required positional argument: 'position_ids'"
PROMPT = torch.tensor([[5, 6, 7]])
# well under the default ban_timeout (15 s), which the client waited out before
QUICKLY = 10.0


def break_blocks(server: InProcessServer) -> Callable[[], None]:
    """From now on every block of ``server`` raises ``TypeError(BUG)`` when it computes; returns the undo."""

    def raise_bug(module, args):
        raise TypeError(BUG)

    handles = [
        backend.module.register_forward_pre_hook(raise_bug)
        for backend in server.server.span.engine.blocks.backends.values()
    ]
    return lambda: [handle.remove() for handle in handles]


@pytest.fixture(scope="module")
def swarm(tiny_model_with_tokenizer):
    """A bootstrap peer and two servers of all 4 blocks: ``fast`` (announcing 1000x the speed, so that
    routes prefer it) and ``slow``; both healthy until a test breaks them."""
    path = tiny_model_with_tokenizer
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())

        def server(speed: float) -> InProcessServer:
            args = ("--block_indices", "0:4", "--torch_dtype", "float32")
            info = ThroughputInfo(speed, forward_rps=speed, inference_rps=speed)
            return stack.enter_context(
                InProcessServer(path, dht.initial_peers, *args, throughput=info).start()
            )

        yield path, dht.initial_peers, server(1000.0), server(1.0)


def client(path, peers, **config):
    return petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, **LOOPBACK_CLIENT, **config
    )


def test_a_broken_server_among_healthy_ones_is_routed_around(swarm):
    path, peers, fast, slow = swarm
    healthy = client(path, peers)
    expected_tokens, expected_logits = healthy.generate(PROMPT, max_new_tokens=4), healthy(PROMPT).logits
    healthy.close()
    undo = break_blocks(fast)
    try:
        for call in ("generate", "forward"):
            model = client(path, peers)
            if call == "generate":
                assert torch.equal(model.generate(PROMPT, max_new_tokens=4), expected_tokens)
            else:
                torch.testing.assert_close(model(PROMPT).logits, expected_logits)
            manager = model.remote_blocks.manager
            assert [str(peer) for peer in manager.bans] == [fast.peer_id]  # tried first, then banned
            model.close()
    finally:
        undo()


@pytest.mark.parametrize("broken", ["the only server", "every server"])
@pytest.mark.parametrize("call", ["generate", "forward"])
def test_a_server_bug_on_every_server_stops_the_client_at_once(swarm, broken, call):
    path, peers, fast, slow = swarm
    undo = [break_blocks(fast)]
    if broken == "every server":
        undo.append(break_blocks(slow))
        allowed = None
    else:
        allowed = [fast.peer_id]  # the client sees only the broken one
    try:
        model = client(path, peers, allowed_servers=allowed)
        started = time.monotonic()
        with pytest.raises(ServerFailure) as caught:
            model.generate(PROMPT, max_new_tokens=4) if call == "generate" else model(PROMPT)
        assert time.monotonic() - started < QUICKLY
        message = str(caught.value)
        assert "every server of blocks 0-3" in message and f"[internal] {BUG}" in message
        assert "\n" not in message
        model.close()
    finally:
        for step in undo:
            step()


def test_petals_generate_says_it_in_one_line(swarm):
    path, peers, fast, slow = swarm
    undo = break_blocks(fast), break_blocks(slow)
    try:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "petals.cli", "generate", str(path), "hi", "--loopback"]
            + [item for peer in peers for item in ("--initial_peers", peer)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for step in undo:
            step()
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: every server of blocks 0-3") and BUG in last, result.stderr
    assert "Traceback" not in result.stderr and "banned; retrying" not in result.stderr, result.stderr
    assert time.monotonic() - started < 60  # a Python start and the client's imports, not a ban's wait
