"""A serving ``petals serve`` process imports what a server uses: not torch's compiler (through transformers),
not scipy's optimizers, not torch.distributed's DTensor and FSDP nor sympy, not hivemind's training
subsystems, not petals' client, apps or tools (``petals.patches`` says how; docs/performance.md what it
saves)."""

from __future__ import annotations

import os
import signal
import sys

import torch

import petals
from conftest import LOOPBACK_CLIENT
from petals.server.server import READY_MESSAGE
from petals.testing.swarm import InProcessDht, ServerProcess

# a package here stands for itself and its submodules
NOT_IMPORTED = (
    "torch._dynamo.convert_frame",  # what dynamo's __init__ imports first: the compiler loaded
    "torch._inductor",
    "scipy.optimize._optimize",
    "torch.distributed.tensor",  # transformers' loading code, for process groups a server never creates
    "torch.distributed.fsdp",
    "sympy",  # through those, and through an explicit backward seed's shape check
    "hivemind.averaging",
    "hivemind.moe",
    "hivemind.optim",
    "petals.client",
    "petals.api",
    "petals.monitor",
    "petals.simulate",
    "petals.testing",
    "petals.cli.generate",
    "petals.cli.chat",
    "petals.cli.simulate",
    "matplotlib",
    "uvicorn",
)

# runs petals.cli.run_server; on SIGUSR1 writes the names in sys.modules to the file named first
LISTING_SERVER = """
import os, runpy, signal, sys

LISTING = sys.argv[1]

def write_modules(signum, frame):
    with open(LISTING + ".part", "w") as listing:
        listing.write("\\n".join(sorted(sys.modules)))
    os.replace(LISTING + ".part", LISTING)

signal.signal(signal.SIGUSR1, write_modules)
sys.argv = sys.argv[1:]
runpy.run_module("petals.cli.run_server", run_name="__main__", alter_sys=True)
"""


def test_a_serving_server_imports_neither_the_compiler_nor_what_clients_apps_and_tools_use(
    tiny_model_path, tmp_path
):
    (tmp_path / "listing_server.py").write_text(LISTING_SERVER)
    listing = tmp_path / "modules.txt"
    path = tiny_model_path("llama")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with InProcessDht().start() as dht:
        peers = [item for peer in dht.initial_peers for item in ("--initial_peers", peer)]
        args = [str(path), "--loopback", *peers, "--torch_dtype", "float32", "--throughput", "1"]
        with ServerProcess("petals serve", ["listing_server", str(listing), *args], env) as server:
            server.wait_for_log(READY_MESSAGE, timeout=180)
            model = petals.AutoDistributedModelForCausalLM.from_pretrained(
                path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
            ids = torch.tensor([[5, 6, 7, 8]])
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # inference steps
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            model(inputs_embeds=embeds).logits.sum().backward()  # forward and backward
            assert embeds.grad is not None
            os.kill(server.pid, signal.SIGUSR1)
            server.wait_for(listing.exists, timeout=30, what="the list of its modules")
    modules = set(listing.read_text().split())
    assert {"torch", "transformers.models.llama.modeling_llama", "petals.server.server"} <= modules
    unused = sorted(
        name
        for name in modules
        if any(name == unwanted or name.startswith(unwanted + ".") for unwanted in NOT_IMPORTED)
    )
    assert unused == []
