"""A bootstrap peer and two servers hosting halves of a tiny model, driven over the raw wire protocol."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from petals.data_structures import ServerInfo, ServerState, make_uids
from petals.loading import load_block
from petals.testing.swarm import InProcessDht, InProcessServer
from petals.testing.wire_client import WireClient

SERVER_ARGS = ("--throughput", "1.0", "--update_period", "2")
ATOL = 1e-4
INFO_FIELDS = {
    "start_block",
    "end_block",
    "version",
    "torch_dtype",
    "quant_type",
    "adapters",
    "cache_tokens_left",
    "inference_rps",
    "forward_rps",
    "network_rps",
    "using_relay",
    "public_name",
    "next_pings",
    "weight_bytes",
    "dequantized_from",
    "packed_as",  # petals-core extension: the stored format a quantized checkpoint is served packed in
    "cache_bytes",  # petals-core extensions: the cache budget in bytes, and what sessions hold by kind
    "cache_bytes_held",
    "cache_pages",  # petals-core extensions: pages by use (live, kept, free), sessions preempted
    "sessions_preempted",
}


class Swarm:
    def __init__(self, model_path, prefix: str) -> None:
        self.model_path, self.prefix = model_path, prefix
        self.dht = InProcessDht().start()
        self.first, self.second = (
            InProcessServer(
                model_path, self.dht.initial_peers, "--block_indices", blocks, *SERVER_ARGS
            ).start(wait=False)
            for blocks in ("0:2", "2:4")
        )
        for server in (self.first, self.second):  # they load in parallel
            server.wait_ready()
        self.client = WireClient(self.dht.initial_peers)

    def close(self) -> None:
        self.client.close()
        for peer in (self.second, self.first, self.dht):
            peer.stop()


@pytest.fixture(scope="module", params=["llama", "bloom"])
def swarm(request, tiny_model_path):
    path = tiny_model_path(request.param)
    swarm = Swarm(path, {"llama": "tiny-llama-hf", "bloom": "tiny-bloom-petals"}[request.param])
    yield swarm
    swarm.close()


def reference_activations(model_path, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The full transformers model's input to block 0 and output of every block."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    layers = model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h
    captured: list[torch.Tensor] = []

    def grab_input(module, args, kwargs):
        captured.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    def grab_output(module, args, kwargs, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    layers[0].register_forward_pre_hook(grab_input, with_kwargs=True)
    for layer in layers:
        layer.register_forward_hook(grab_output, with_kwargs=True)
    with torch.no_grad():
        model(input_ids)
    return captured


def test_records_have_petals_types(swarm):
    uids = make_uids(swarm.prefix, 0, 4)
    for uid, server in zip(uids, [swarm.first] * 2 + [swarm.second] * 2, strict=True):
        entry = swarm.client.dht_get(uid)
        assert isinstance(entry.value, dict) and list(entry.value) == [server.peer_id]
        state, throughput, info = entry.value[server.peer_id].value
        assert type(state) is int and state == ServerState.ONLINE
        assert type(throughput) is float and throughput == 1.0
        assert set(info) == INFO_FIELDS and isinstance(info["adapters"], tuple)
        assert (info["start_block"], info["end_block"]) == ((0, 2) if server is swarm.first else (2, 4))
        assert info["torch_dtype"] == "float32" and info["quant_type"] == "none"
        assert type(info["cache_tokens_left"]) is int and info["cache_tokens_left"] > 0
        assert type(info["cache_bytes"]) is int and info["cache_bytes"] > 0
        assert {kind: type(nbytes) for kind, nbytes in info["cache_bytes_held"].items()} == {
            "full_attention": int
        }
        assert info["cache_pages"]["free"] > 0 and info["sessions_preempted"] == 0
        ServerInfo.from_tuple(entry.value[server.peer_id].value)
    models = swarm.client.dht_get("_petals.models").value
    assert models[swarm.prefix].value == {"num_blocks": 4, "repository": None}


SERVER_INFO_KEYS = {"version", "dht_client_mode", "cache_tokens_available"}
# petals-core's extra keys (stock Petals peers ignore them): counters, the cache's pages by use (live, kept:
# lent by idle and kept sessions, free) and the sessions waiting for admission
EXTENSION_INFO_KEYS = {"stats", "cache_pages", "cache_queue"}


def test_rpc_info(swarm):
    info = swarm.client.info(swarm.first.peer_id, f"{swarm.prefix}.0")
    assert set(info) == SERVER_INFO_KEYS | EXTENSION_INFO_KEYS | {
        "forward_schema",
        "outputs_schema",
        "keyword_names",
        "inference_schema",
    }
    (hidden_schema,), kwargs = info["forward_schema"]
    assert kwargs == {} and hidden_schema.dtype == torch.float32 and hidden_schema.shape[-1] == 64
    assert info["keyword_names"] == () and len(info["inference_schema"][0]) == 3
    assert set(swarm.client.info(swarm.first.peer_id)) == SERVER_INFO_KEYS | EXTENSION_INFO_KEYS


def test_forward_through_both_servers_matches_transformers(swarm):
    input_ids = torch.randint(0, 1000, (2, 7))
    reference = reference_activations(swarm.model_path, input_ids)
    middle = swarm.client.forward(swarm.first.peer_id, make_uids(swarm.prefix, 0, 2), reference[0])
    output = swarm.client.forward(swarm.second.peer_id, make_uids(swarm.prefix, 2, 4), middle)
    torch.testing.assert_close(middle, reference[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(output, reference[4], atol=ATOL, rtol=0)


def test_forward_stream_matches_unary(swarm):
    from petals.testing.wire_client import make_request
    from petals.wire import deserialize_tensors, request_parts

    hidden = torch.randn(1, 5, 64)
    uids = make_uids(swarm.prefix, 0, 2)
    unary = swarm.client.forward(swarm.first.peer_id, uids, hidden)
    request = make_request(uids, [hidden, torch.empty(0)], {})
    responses = swarm.client.call_stream(
        swarm.first.peer_id,
        "rpc_forward_stream",
        request_parts(request.uid, request.tensors, request.metadata),
    )
    (streamed,) = deserialize_tensors([part for response in responses for part in response.tensors])
    torch.testing.assert_close(streamed, unary)


def test_inference_through_both_servers_matches_transformers(swarm):
    input_ids = torch.randint(0, 1000, (2, 8))
    reference = reference_activations(swarm.model_path, input_ids)
    first = swarm.client.inference(swarm.first.peer_id, make_uids(swarm.prefix, 0, 2), max_length=10)
    second = swarm.client.inference(swarm.second.peer_id, make_uids(swarm.prefix, 2, 4), max_length=10)
    outputs = []
    for start, end in [(0, 5), (5, 6), (6, 7), (7, 8)]:  # a prefill, then one token per step
        middle = first.step(reference[0][:, start:end])
        outputs.append(second.step(middle))
    first.close()
    second.close()
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference[4], atol=ATOL, rtol=0)


def test_backward_matches_local_autograd(swarm):
    hidden = torch.randn(2, 6, 64)
    grad_output = torch.randn(2, 6, 64)
    blocks = [load_block(swarm.model_path, index, torch.float32) for index in range(4)]
    local_input = hidden.clone().requires_grad_(True)
    local_output = local_input
    for block in blocks:
        local_output = block(local_output, None)
    (expected,) = torch.autograd.grad(local_output, local_input, grad_output)

    middle = swarm.client.forward(swarm.first.peer_id, make_uids(swarm.prefix, 0, 2), hidden)
    (grad_middle,) = swarm.client.backward(
        swarm.second.peer_id, make_uids(swarm.prefix, 2, 4), middle, grad_output
    )
    (grad_input,) = swarm.client.backward(
        swarm.first.peer_id, make_uids(swarm.prefix, 0, 2), hidden, grad_middle
    )
    torch.testing.assert_close(grad_input, expected, atol=ATOL, rtol=1e-4)
