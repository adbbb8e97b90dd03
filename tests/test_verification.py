"""Verified outputs (``verify``): a server whose outputs are perturbed is caught by a second and a third
server of the same blocks, banned, reported, and its lies never reach the tokens; honest servers with
different dtypes, thread counts and batch merges are never accused."""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT
from petals.api.app import verification_metrics
from petals.client.verification import relative_error, tolerance
from petals.testing.inprocess import InProcessDht, InProcessServer
from petals.testing.liar import make_liar, perturb

BLOCKS = ("--block_indices", "0:4")
FP32 = ("--torch_dtype", "float32")


@contextlib.contextmanager
def swarm_with_a_liar(path, relative: float, every: int, honest: int = 2):
    """A bootstrap peer, ``honest`` float32 servers of blocks 0:4 and a lying one; yields (peers, liar, lies)."""
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        servers = [InProcessServer(path, dht.initial_peers, *BLOCKS, *FP32) for _ in range(honest + 1)]
        for server in servers:
            server.start(wait=False)
        for server in servers:
            stack.enter_context(server.wait_ready())
        liar = servers[-1]
        lies = make_liar(liar.server, relative=relative, every=every)
        yield dht.initial_peers, liar, lies


def prompt(seed: int = 5, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(seed))


def test_perturbation_is_what_the_liar_claims():
    output = torch.randn(2, 3, 64)
    lied = perturb(output, 1e-2, torch.Generator().manual_seed(0))
    assert relative_error(lied, output) == pytest.approx(1e-2, rel=1e-3)
    assert tolerance("float32") < 1e-2 < tolerance("bfloat16")
    assert tolerance("float32", None) == tolerance("bfloat16")  # unknown: the coarsest


def test_a_liar_on_every_step_is_caught_and_the_tokens_equal_local(tiny_model_path, caplog):
    path = tiny_model_path("llama")
    ids = prompt()
    greedy = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(ids, **greedy)
    with swarm_with_a_liar(path, relative=1e-2, every=1) as (peers, liar, lies):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=peers, verify=1.0, **LOOPBACK_CLIENT
        )
        try:
            with caplog.at_level(logging.WARNING, logger="petals.client.suspects"):
                output = model.generate(ids, **greedy)
                again = model.generate(ids, **greedy)
            suspects = model.suspects()
            metrics = verification_metrics(model.remote_blocks.manager.suspects)
        finally:
            model.close()
    assert lies, "the liar was never asked anything"
    assert "petals_client_suspects_total 1\n" in metrics  # what petals api's /metrics shows
    assert [suspect.peer_id for suspect in suspects] == [liar.peer_id]
    assert suspects[0].blocks == (0, 4) and suspects[0].checks <= 20, suspects
    assert "relative error 1.0e-02 against server" in suspects[0].evidence
    warnings = [record for record in caplog.records if liar.peer_id in record.getMessage()]
    assert len(warnings) == 1, [record.getMessage() for record in caplog.records]
    assert torch.equal(output, expected) and torch.equal(again, expected)


def test_a_liar_on_one_step_in_ten_is_caught_within_200_steps(tiny_model_path):
    path = tiny_model_path("llama")
    with swarm_with_a_liar(path, relative=1e-2, every=10) as (peers, liar, lies):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=peers, verify=1.0, **LOOPBACK_CLIENT
        )
        generator = torch.Generator().manual_seed(3)
        steps = 0
        try:
            with model.inference_session(max_length=200) as session:
                while steps < 200 and not model.suspects():
                    session.step(torch.randn(1, 1, model.config.hidden_size, generator=generator))
                    steps += 1
            suspects = model.suspects()
        finally:
            model.close()
    print(f"caught after {steps} steps, {suspects and suspects[0].checks} checks, lies at steps {lies}")
    assert [suspect.peer_id for suspect in suspects] == [liar.peer_id], f"not caught in {steps} steps"
    assert len(lies) >= 1


HONEST_SESSIONS = 4
HONEST_STEPS = 130  # x 4 sessions x 2 models: over 1,000 checks


def test_honest_servers_are_never_accused(tiny_model_path):
    """1,040 verified steps over float32 and bfloat16 servers with 1 and 2 decode threads, from sessions
    running at once (their steps merge into one batch on the servers; replays run solo)."""
    path = tiny_model_path("llama")
    variants = [
        ("float32", "1"),
        ("float32", "2"),
        ("float32", "2"),
        ("bfloat16", "1"),
        ("bfloat16", "2"),
        ("bfloat16", "2"),
    ]
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        servers = [
            InProcessServer(
                path, dht.initial_peers, *BLOCKS, "--torch_dtype", dtype, "--decode_threads", threads
            )
            for dtype, threads in variants
        ]
        for server in servers:
            server.start(wait=False)
        for server in servers:
            stack.enter_context(server.wait_ready())
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, verify=1.0, **LOOPBACK_CLIENT
        )
        stack.callback(model.close)
        errors: list[BaseException] = []

        def generate(seed: int, dtype: torch.dtype) -> None:
            generator = torch.Generator().manual_seed(seed)
            try:
                with model.inference_session(max_length=HONEST_STEPS + 8) as session:
                    session.step(torch.randn(2, 8, model.config.hidden_size, generator=generator).to(dtype))
                    for _ in range(HONEST_STEPS - 1):
                        session.step(
                            torch.randn(2, 1, model.config.hidden_size, generator=generator).to(dtype)
                        )
            except BaseException as error:
                errors.append(error)

        for dtype in (torch.float32, torch.bfloat16):
            threads = [
                threading.Thread(target=generate, args=(seed, dtype)) for seed in range(HONEST_SESSIONS)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        suspects = model.remote_blocks.manager.suspects
        assert not errors, errors
        assert suspects.checks >= 1000
        print(f"{suspects.checks} checks, closest call {suspects.closest_call:.2f} of the tolerance")
        assert suspects.mismatches == 0 and not model.suspects()


def test_with_no_second_server_the_clients_own_copy_of_the_blocks_judges(tiny_model_path):
    """The liar serves 0:4 alone; honest servers serve 0:2 and 2:4. No server can recompute the liar's
    span (nor, once it is banned, a third opinion for theirs): the client, whose model is a local
    checkpoint, runs the blocks itself."""
    path = tiny_model_path("llama")
    ids = prompt(seed=9)
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(ids, **greedy)
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        ranges = ("0:4", "0:2", "2:4")
        servers = [InProcessServer(path, dht.initial_peers, "--block_indices", r, *FP32) for r in ranges]
        for server in servers:
            server.start(wait=False)
        for server in servers:
            stack.enter_context(server.wait_ready())
        liar = servers[0]
        make_liar(liar.server, relative=1e-2, every=1)
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, verify=1.0, **LOOPBACK_CLIENT
        )
        stack.callback(model.close)
        output = model.generate(ids, **greedy)
        suspects = model.suspects()
    assert [suspect.peer_id for suspect in suspects] == [liar.peer_id]
    assert "this client's own computation" in suspects[0].evidence
    assert torch.equal(output, expected)
