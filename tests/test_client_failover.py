"""A server dying mid-generation costs time, not tokens: its blocks move to a replacement."""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT, KillServingServer, swarm_with_processes
from petals.server.server import READY_MESSAGE
from petals.testing.swarm import start_server

RUNS = 5
NEW_TOKENS = 32
KILL_AFTER = 10


def test_greedy_generation_survives_a_killed_server(tiny_model_path):
    path = tiny_model_path("llama")
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(ids, **kwargs)
    server_args = ("--update_period", "3")  # a killed server's records expire within seconds

    swarm = swarm_with_processes(path, "0:2", "2:4", "2:4", processes=2, server_args=server_args)
    with swarm as (dht, servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, request_timeout=20, **LOOPBACK_CLIENT
        )
        with contextlib.ExitStack() as replacements:
            for _ in range(RUNS):
                started = time.perf_counter()
                with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
                    killer = KillServingServer(session, servers, ids.shape[1], KILL_AFTER)
                    output = model.generate(ids, stopping_criteria=[killer], **kwargs)
                    survivors = {str(span.peer_id) for span in session.route}
                assert killer.killed is not None, "the session never reached the kill point"
                assert killer.killed.peer_id not in survivors
                assert torch.equal(output, expected), (
                    f"tokens differ after failover ({time.perf_counter() - started:.1f} s)"
                )
                servers.remove(killer.killed)
                killer.killed.stop()
                replacement = replacements.enter_context(
                    start_server(
                        path,
                        dht.initial_peers,
                        "--block_indices",
                        "2:4",
                        "--torch_dtype",
                        "float32",
                        *server_args,
                        timeout=120,
                    )
                )
                replacement.wait_for_log(READY_MESSAGE, timeout=120)
                servers.append(replacement)
        model.remote_blocks.network.close()


def test_deep_prompts_are_replayed_to_the_replacement(tiny_model_path):
    """The replacement rebuilds its cache from the history *with* the deep prompts of its blocks."""
    path = tiny_model_path("llama")
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(11))
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )

    server_args = ("--update_period", "3")
    swarm = swarm_with_processes(path, "0:2", "2:4", "2:4", processes=2, server_args=server_args)
    with swarm as (dht, servers):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path,
            initial_peers=dht.initial_peers,
            request_timeout=20,
            tuning_mode="deep_ptune",
            pre_seq_len=3,
            **LOOPBACK_CLIENT,
        )
        with torch.no_grad():  # random deep prompts: a replay that drops them shifts the logits
            for embedding in (model.prompt_embeddings, model.intermediate_prompt_embeddings):
                embedding.weight.normal_(std=3.0, generator=torch.Generator().manual_seed(5))
        expected = model.generate(ids, **kwargs)
        with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
            killer = KillServingServer(session, servers, ids.shape[1], KILL_AFTER)
            output = model.generate(ids, stopping_criteria=[killer], **kwargs)
            survivors = {str(span.peer_id) for span in session.route}
        assert killer.killed is not None and killer.killed.peer_id not in survivors
        assert torch.equal(output.sequences, expected.sequences)
        # tokens alone are too coarse on a tiny random model: the logits show whether the cache is exact
        diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
        assert diff < 1e-4
        model.close()
