"""What a user sees when the swarm cannot serve a request."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hivemind.p2p import PeerID

import petals
from conftest import LOOPBACK_CLIENT, inprocess_swarm
from petals.client.routing import MissingBlocksError, RouteBanned, Verdict, ban_seconds, judge_failure
from petals.network.client import SwarmUnreachableError
from petals.plugins import UnknownModelTypeError


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    """Two servers of all 4 blocks; tests that need the only server of some blocks allow one of them."""
    path = tiny_model_path("llama")
    servers = ("0:4", "0:4")
    with inprocess_swarm(path, *servers, server_args=("--inference_max_length", "64")) as (dht, running):
        yield path, dht.initial_peers, [server.peer_id for server in running]


def test_missing_blocks_name_the_prefix_and_block(swarm):
    path, peers, _ = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, dht_prefix="nobody-serves-this", **LOOPBACK_CLIENT
    )
    with pytest.raises(MissingBlocksError, match=r"nobody-serves-this\.0.*no ONLINE server"):
        model(torch.tensor([[5, 6, 7]]))


def test_an_adapter_no_server_has_is_named_with_the_block(swarm):
    path, peers, _ = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, active_adapter="my-lora", max_retries=None, **LOOPBACK_CLIENT
    )
    expected = r"block \S+\.0 has the adapter 'my-lora' .*offer no adapters.*--adapters my-lora"
    with pytest.raises(MissingBlocksError, match=expected):  # at once, although retries are unlimited
        model(torch.tensor([[5, 6, 7]]))
    with pytest.raises(MissingBlocksError, match=expected):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    model.close()


def test_the_only_server_of_some_blocks_is_used_though_banned(swarm):
    """A ban only steers routes to other servers: the only server of some blocks (here the one this client
    may use), banned after a failure while it had company, still serves the next request at once. A server
    caught lying is banned for good: nothing to wait for."""
    path, peers, (only, _) = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, allowed_servers=[only], **LOOPBACK_CLIENT
    )
    expected = model(torch.tensor([[5, 6, 7]])).logits
    manager = model.remote_blocks.manager
    (peer,) = manager.spans
    manager.on_request_failure(peer)  # as after a failed request, when another server held these blocks
    assert manager.bans[peer].until > time.monotonic() and manager.usable_spans() == [manager.spans[peer]]
    torch.testing.assert_close(model(torch.tensor([[5, 6, 7]])).logits, expected)
    span = manager.spans[peer]
    manager.suspects.accuse(peer, span, "a lie")  # banned for good: nothing to wait for
    with pytest.raises(MissingBlocksError, match="wrong outputs") as refused:
        model(torch.tensor([[5, 6, 7]]))
    assert not isinstance(refused.value, RouteBanned)
    model.close()


def test_a_route_whose_servers_are_all_banned_is_refused_at_once_then_served(swarm):
    """Both servers of the blocks failed lately and are banned: the request is refused at once with
    ``RouteBanned``, which says when the first ban ends, instead of sleeping through the ban; once it has
    ended, the request is served."""
    path, peers, _ = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, ban_timeout=1.0, **LOOPBACK_CLIENT
    )
    expected = model(torch.tensor([[5, 6, 7]])).logits
    manager = model.remote_blocks.manager
    for peer in list(manager.spans):
        manager.on_request_failure(peer)
    assert manager.usable_spans() == []
    with pytest.raises(RouteBanned, match=r"banned for now; retry in 1 s") as refused:
        model(torch.tensor([[5, 6, 7]]))
    assert 0 < refused.value.retry_after <= 1.0
    time.sleep(refused.value.retry_after)
    torch.testing.assert_close(model(torch.tensor([[5, 6, 7]])).logits, expected)
    model.close()


def test_the_only_server_of_its_blocks_is_waited_for_not_banned(swarm):
    """A failure of the only server of some blocks is retried after the backoff: a ban could only turn
    its stall into an outage. With a second server, the failed one is banned and routed around."""
    path, peers, (only, _) = swarm
    for allowed, banned in (([only], False), (None, True)):
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=peers, allowed_servers=allowed, min_backoff=0.01, **LOOPBACK_CLIENT
        )
        manager = model.remote_blocks.manager
        model(torch.tensor([[5, 6, 7]]))
        peer = PeerID.from_base58(only)
        assert manager.only_server(peer) is not banned
        model.remote_blocks.network.run(manager.handle_failure(TimeoutError("stalled"), peer, attempt=1))
        assert (peer in manager.bans) is banned
        model.close()


def test_bans_are_capped_and_one_stall_is_one_failure(swarm):
    """Bans double per failure up to a minute; the failures of requests that were in flight when a
    server was banned (32 sessions hit by one stall) do not ban it again."""
    assert [ban_seconds(15, failures) for failures in (1, 2, 3, 4, 40, 10_000)] == [15, 30, 60, 60, 60, 60]
    assert judge_failure(TimeoutError(), only_server=False) == Verdict(retry=True, ban=True)
    assert judge_failure(TimeoutError(), only_server=True) == Verdict(retry=True, ban=False)
    path, peers, _ = swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, **LOOPBACK_CLIENT
    )
    manager = model.remote_blocks.manager
    model(torch.tensor([[5, 6, 7]]))
    peer = next(iter(manager.spans))
    for _ in range(32):
        manager.on_request_failure(peer)
    assert manager.bans[peer].failures == 1
    assert manager.bans[peer].until - time.monotonic() <= model.config.ban_timeout
    model.close()


def test_max_length_beyond_every_server_is_refused(swarm):
    path, peers, _ = swarm
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
    path, peers, _ = swarm
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
    assert judge_failure(error) == Verdict(retry=True, ban=True)  # retried elsewhere, this server banned for a while
