"""What a user sees when the swarm cannot serve a request."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import petals
from conftest import LOOPBACK_CLIENT, inprocess_swarm
from petals.client.routing import MissingBlocksError
from petals.network.client import SwarmUnreachableError
from petals.plugins import UnknownModelTypeError


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    path = tiny_model_path("llama")
    with inprocess_swarm(path, "0:4", server_args=("--inference_max_length", "64")) as (dht, _):
        yield path, dht.initial_peers


def test_missing_blocks_name_the_prefix_and_block(swarm):
    path, peers = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, dht_prefix="nobody-serves-this", **LOOPBACK_CLIENT
    )
    with pytest.raises(MissingBlocksError, match=r"nobody-serves-this\.0.*no ONLINE server"):
        model(torch.tensor([[5, 6, 7]]))


def test_an_adapter_no_server_has_is_named_with_the_block(swarm):
    path, peers = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, active_adapter="my-lora", max_retries=None, **LOOPBACK_CLIENT
    )
    expected = r"block \S+\.0 has the adapter 'my-lora' .*offer no adapters.*--adapters my-lora"
    with pytest.raises(MissingBlocksError, match=expected):  # at once, although retries are unlimited
        model(torch.tensor([[5, 6, 7]]))
    with pytest.raises(MissingBlocksError, match=expected):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    model.close()


def test_a_request_waits_for_the_ban_of_the_only_server_to_end(swarm):
    """A server banned after a failure is the only one for its blocks: the next request waits for its
    ban to end (``ban_timeout``) and is served, instead of failing with MissingBlocksError at once."""
    path, peers = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, ban_timeout=1.0, **LOOPBACK_CLIENT
    )
    expected = model(torch.tensor([[5, 6, 7]])).logits
    manager = model.remote_blocks.manager
    (peer,) = manager.spans
    manager.on_request_failure(peer)  # as after a failed request
    assert manager.usable_spans() == []
    torch.testing.assert_close(model(torch.tensor([[5, 6, 7]])).logits, expected)
    span = manager.spans[peer]
    manager.suspects.accuse(peer, span, "a lie")  # banned for good: nothing to wait for
    with pytest.raises(MissingBlocksError, match="wrong outputs"):
        model(torch.tensor([[5, 6, 7]]))
    model.close()


def test_max_length_beyond_every_server_is_refused(swarm):
    path, peers = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, **LOOPBACK_CLIENT
    )
    with pytest.raises(ValueError, match="inference_max_length"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=100)


def test_unreachable_swarm(tiny_model_path):
    dead_peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    with pytest.raises(SwarmUnreachableError, match="initial_peers"):
        petals.AutoDistributedModelForCausalLM.from_pretrained(
            tiny_model_path("llama"), initial_peers=[dead_peer], daemon_startup_timeout=15, **LOOPBACK_CLIENT
        )


def test_model_type_without_plugin(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(
        UnknownModelTypeError, match="model type 'mamba' has no installed plugin; installed: .*llama"
    ):
        petals.AutoDistributedModelForCausalLM.from_pretrained(
            tmp_path, initial_peers=["/ip4/127.0.0.1/tcp/1"]
        )


def test_leaving_the_swarm_prints_no_pending_task_warnings(swarm):
    """WireClient.close() and a model left open at exit shut their loops and daemons down cleanly."""
    path, peers = swarm
    script = textwrap.dedent(
        """
        import sys, torch, petals
        from petals.testing.swarm import LOOPBACK_CLIENT
        from petals.testing.wire_client import WireClient

        path, *peers = sys.argv[1:]
        client = WireClient(peers)
        client.dht_get("_petals.models")
        client.close()
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=peers, **LOOPBACK_CLIENT
        )
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
        print("done")  # the model stays open: its network leaves at interpreter exit
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(path), *peers], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "done" in result.stdout, result.stderr
    assert "Task was destroyed" not in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


@pytest.mark.parametrize("answer", ["nothing", "cut short"])
def test_a_streamed_answer_that_ends_early_is_a_server_fault_to_retry_elsewhere(answer):
    """A stream that closes early ends like a complete one (the reader sees only the close): an empty or
    cut-short answer to a streamed forward is the server's (or the link's) fault, retried on another
    server, not a ValueError that ends the user's call."""
    from hivemind.proto import runtime_pb2

    from petals.client.routing import judge_failure
    from petals.network.p2p import LOOPBACK_MADDRS, NetworkOptions, leave_network
    from petals.network.rpc import call_chain, protocol
    from petals.wire import MAX_UNARY_PAYLOAD_SIZE, serialize_tensor, split_tensor

    hidden = torch.zeros(1, MAX_UNARY_PAYLOAD_SIZE // 4 + 1)  # over the unary limit: streamed

    async def early_end(requests, context):
        async for _ in requests:
            pass
        if answer == "cut short":
            parts = split_tensor(serialize_tensor(hidden), chunk_size=MAX_UNARY_PAYLOAD_SIZE // 2)
            yield runtime_pb2.ExpertResponse(tensors=parts[:1])

    async def scenario() -> BaseException:
        loopback = dict(host_maddrs=LOOPBACK_MADDRS, nat_port_map=False, auto_nat=False, use_relay=False)
        server = await NetworkOptions(**loopback).create_p2p()
        client = None
        try:
            await server.add_protobuf_handler(
                protocol("rpc_forward_stream"),
                early_end,
                runtime_pb2.ExpertRequest,
                stream_input=True,
                stream_output=True,
            )
            maddrs = [str(maddr) for maddr in await server.get_visible_maddrs()]
            client = await NetworkOptions(initial_peers=maddrs, **loopback).create_p2p()
            with pytest.raises(EOFError) as error:
                await call_chain(client, server.peer_id, "rpc_forward", "x.0", [hidden], {}, timeout=30)
            return error.value
        finally:
            for p2p in (client, server):
                if p2p is not None:
                    await leave_network(p2p, None)

    error = asyncio.run(scenario())
    expected = (
        "without an answer" if answer == "nothing" else "cut short: a streamed tensor announced 3 parts but 1"
    )
    assert expected in str(error)
    assert judge_failure(error) == (True, True)  # retried elsewhere, this server banned for a while
