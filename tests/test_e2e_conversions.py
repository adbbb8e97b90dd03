"""Converted blocks served by real ``petals serve`` processes, used by the real client.

One bootstrap peer and nine servers on 127.0.0.1, started together (each under its own
``--dht_prefix``), hosting every block of their model:

- ``--quant_type int8`` / ``nf4`` for a Llama and a Mixtral of hidden size 256 (as in
  test_convert_quantization, so bitsandbytes' scales weigh what they weigh in real models);
- ``--tensor_parallel_devices cpu cpu`` for Llama, BLOOM, Falcon (new architecture) and Mixtral;
- two LoRA adapters on one Llama server, started without --num_blocks (it plans its blocks).

Quantized logits are compared with the fp32 model by relative error ``‖logits − fp32‖ / ‖fp32‖``
(batch 2 × 8 tokens). Measured with ``pytest tests/test_e2e_conversions.py -s``: int8 0.013 (Llama),
0.035 (Mixtral); nf4 0.19 (both); weight memory (the server's log line and announced
``weight_bytes``) int8 0.254×, nf4 0.133× of fp32. The bounds below leave headroom for other seeds.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import petals
from conftest import LOOPBACK_CLIENT, tiny_config
from petals.block import cache_spec
from petals.convert import block_weight_bytes, convert_block
from petals.data_structures import make_uids
from petals.loading import load_block
from petals.server.backend import BlockBackend
from petals.server.server import READY_MESSAGE
from petals.testing.swarm import InProcessDht, InProcessServer, ServerProcess, start_server
from petals.testing.wire_client import WireClient, make_request

MAX_LOGITS_ERROR = {"int8": 0.1, "nf4": 0.3}
MAX_MEMORY_RATIO = {"int8": 0.55, "nf4": 0.3}
QUANTIZED = [(family, quant) for family in ("llama", "mixtral") for quant in ("int8", "nf4")]
SHARDED = ["llama", "bloom", "falcon-new", "mixtral"]
DEVICES = ("cpu", "cpu")
ADAPTERS = {
    "attn": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    "mlp": LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"], init_lora_weights=False),
}
ADAPTED_PREFIX = "adapted-llama"
SERVER_ARGS = ("--torch_dtype", "float32", "--throughput", "1.0")
WEIGHT_MEMORY = re.compile(r"Weight memory: .* \((\d+) bytes\)")


def wide_model(variant: str, path):
    """A two-block model of hidden size 256, saved in the HF layout."""
    config = tiny_config(variant)
    config.update({"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_hidden_layers": 2})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def save_adapters(model_path, directory) -> dict[str, str]:
    """Each adapter of ``ADAPTERS`` on the model, saved with safetensors; name → directory."""
    paths = {}
    for seed, (name, lora_config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), lora_config)
        model.save_pretrained(directory / name, safe_serialization=True)
        paths[name] = str(directory / name)
    return paths


@dataclass
class Swarm:
    initial_peers: list[str]
    servers: dict[str, ServerProcess | InProcessServer]  # by dht_prefix
    paths: dict[str, Path]  # each server's model, by dht_prefix
    adapters: dict[str, str]  # adapter directory (the name clients ask for), by short name


def start(name: str, path: Path, initial_peers: list[str], *args: str) -> ServerProcess | InProcessServer:
    """Servers whose log a test reads are ``petals serve`` processes; the sharded ones run in this process.
    Neither waits until it is ready."""
    if name.startswith("tp-"):
        return InProcessServer(path, initial_peers, *args, *SERVER_ARGS).start(wait=False)
    return start_server(
        path, initial_peers, *args, *SERVER_ARGS, wait_ready=False, wait_joined=False, timeout=240
    )


@pytest.fixture(scope="module")
def swarm(tiny_model_path, tmp_path_factory) -> Swarm:
    root = tmp_path_factory.mktemp("conversions")
    wide = {family: wide_model(family, root / f"wide-{family}") for family in ("llama", "mixtral")}
    adapters = save_adapters(tiny_model_path("llama"), root)
    launches = {
        f"{family}-{quant}": (wide[family], "--block_indices", "0:2", "--quant_type", quant)
        for family, quant in QUANTIZED
    } | {
        f"tp-{family}": (tiny_model_path(family), "--num_blocks", "4", "--tensor_parallel_devices", *DEVICES)
        for family in SHARDED
    }
    launches[ADAPTED_PREFIX] = (tiny_model_path("llama"), "--adapters", *adapters.values())  # no --num_blocks
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        in_process_first = sorted(launches.items(), key=lambda launch: not launch[0].startswith("tp-"))
        servers = {
            name: stack.enter_context(start(name, path, dht.initial_peers, "--dht_prefix", name, *args))
            for name, (path, *args) in in_process_first
        }
        for server in servers.values():
            if isinstance(server, InProcessServer):
                server.wait_ready(timeout=240)
            else:
                server.wait_for_log(READY_MESSAGE, timeout=240)
        paths = {name: path for name, (path, *_) in launches.items()}
        yield Swarm(dht.initial_peers, servers, paths, adapters)


def remote_model(swarm: Swarm, name: str, **kwargs):
    return petals.AutoDistributedModelForCausalLM.from_pretrained(
        swarm.paths[name], initial_peers=swarm.initial_peers, dht_prefix=name, **LOOPBACK_CLIENT, **kwargs
    )


def prompt(batch: int = 1, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 32, (batch, length), generator=torch.Generator().manual_seed(1))


def close(remote) -> None:
    remote.remote_blocks.network.close()


# ---- quantization ------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "quant_type"), QUANTIZED)
def test_quantized_server_generates_close_to_fp32_in_less_memory(swarm, family, quant_type):
    name = f"{family}-{quant_type}"
    path = swarm.paths[name]
    remote = remote_model(swarm, name)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt(batch=2, length=8)
    try:
        with torch.no_grad():
            expected, got = local(ids).logits, remote(ids).logits
        generated = remote.generate(ids[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False)
        (span,) = remote.remote_blocks.manager.usable_spans()
    finally:
        close(remote)
    error = ((got - expected).norm() / expected.norm()).item()
    fp32_bytes = sum(block_weight_bytes(load_block(path, index)) for index in range(2))
    weight_bytes = int(WEIGHT_MEMORY.search(swarm.servers[name].log).group(1))
    ratio = weight_bytes / fp32_bytes
    print(f"{name}: logits relative error {error:.4f}, weight memory {ratio:.3f}x fp32")
    assert error <= MAX_LOGITS_ERROR[quant_type]
    assert ratio <= MAX_MEMORY_RATIO[quant_type]
    assert span.server_info.quant_type == quant_type and span.server_info.weight_bytes == weight_bytes
    assert generated.shape == (1, 14) and torch.equal(generated[:, :8], ids[:1])


# ---- tensor parallelism ------------------------------------------------------------------------


@pytest.mark.parametrize("family", SHARDED)
def test_sharded_server_equals_local_model_through_cached_steps(swarm, tiny_model_path, family):
    remote = remote_model(swarm, f"tp-{family}")
    local = AutoModelForCausalLM.from_pretrained(tiny_model_path(family), dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (2, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    try:
        with torch.no_grad():
            expected = local(ids).logits
            full = remote(ids).logits
            with remote.inference_session(max_length=8):
                steps = [remote(ids[:, :5]).logits, remote(ids[:, 5:6]).logits, remote(ids[:, 6:]).logits]
        generated = remote.generate(ids[:1], **kwargs)
    finally:
        close(remote)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)
    assert torch.equal(generated, local.generate(ids[:1], **kwargs))


@pytest.mark.parametrize("family", ["llama", "falcon-multi-query"])
def test_sharded_sessions_are_budgeted_by_the_bytes_their_caches_take(tiny_model_path, family):
    block = load_block(tiny_model_path(family), 0)
    module = convert_block(
        block, 0, block.config, dtype=torch.float32, device="cpu", tensor_parallel_devices=DEVICES
    )
    backend = BlockBackend("tp.0", 0, module, block.config, torch.float32, torch.device("cpu"))
    cache = backend.allocate_cache(batch_size=2, max_length=8)
    assert len(cache.parts) == 2 and cache.nbytes == 2 * 8 * backend.bytes_per_token
    copies = 2 if family == "falcon-multi-query" else 1  # one shared key/value head is kept by both shards
    assert backend.bytes_per_token == copies * cache_spec(block.config, 0).bytes_per_token(torch.float32)


# ---- adapters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [None, "attn", "mlp"])
def test_each_adapter_equals_local_peft_and_none_equals_base(swarm, tiny_model_path, adapter):
    adapters = swarm.adapters
    local = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), dtype=torch.float32)
    if adapter is not None:
        local = PeftModel.from_pretrained(local, adapters[adapter])
    local.eval()
    remote = remote_model(swarm, ADAPTED_PREFIX, active_adapter=adapters.get(adapter))
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    try:
        with torch.no_grad():
            got, expected = remote(ids).logits, local(ids).logits
        generated = remote.generate(ids, **kwargs)
    finally:
        close(remote)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert torch.equal(generated, local.generate(ids, **kwargs))


def test_adapters_are_announced_and_an_unknown_one_fails_alone(swarm):
    client, server = WireClient(swarm.initial_peers), swarm.servers[ADAPTED_PREFIX]
    uids = make_uids(ADAPTED_PREFIX, 0, 4)
    try:
        (info,) = client.module_infos(uids[:1])
        (server_info,) = info.servers.values()
        assert server_info.adapters == tuple(swarm.adapters.values())
        request = make_request(uids, [torch.randn(1, 2, 64), torch.empty(0)], {"active_adapter": "chat"})
        with pytest.raises(
            P2PHandlerError, match=r"unknown adapter 'chat'; this server has: .*/attn, .*/mlp"
        ):
            client.call(server.peer_id, "rpc_forward", request)
        request = make_request(
            uids, [torch.randn(1, 2, 64), torch.empty(0)], {"active_adapter": swarm.adapters["mlp"]}
        )
        assert client.call(server.peer_id, "rpc_forward", request).tensors  # still serving
    finally:
        client.close()


# ---- memory planning ---------------------------------------------------------------------------


def test_server_without_num_blocks_plans_them_and_logs_the_arithmetic(swarm):
    log = swarm.servers[ADAPTED_PREFIX].log
    plan = re.search(
        r"Memory plan: (\d+) blocks = the most consecutive of the model's 4 that fit in [\d.]+ GiB memory on cpu "
        r"- [\d.]+ GiB autograd reserve; per block: [\d.]+ GiB weights \(none, float32\) "
        r"\+ [\d.]+ GiB KV cache for 16384 tokens \+ [\d.]+ GiB adapters",
        log,
    )
    assert plan and plan.group(1) == "4", log
    assert f"{READY_MESSAGE}: blocks 0:4" in log
