"""A newcomer's first hour, as the README tells it: the demo without root, the Python client on
127.0.0.1, and the smaller promises of the README's first sections."""

from __future__ import annotations

from pathlib import Path

import torch

import petals

ROOT = Path(__file__).resolve().parent.parent


def p2pd_arguments(model) -> list[str]:
    """The command line of the p2p daemon that ``model``'s client peer started (from /proc)."""
    child = model.remote_blocks.network.p2p._child
    return Path(f"/proc/{child.pid}/cmdline").read_bytes().decode().split("\0")


def test_loopback_keeps_a_python_client_on_127_0_0_1(tiny_llama_swarm):
    path, peers = tiny_llama_swarm
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=peers, loopback=True)
    try:
        arguments = p2pd_arguments(model)
        for flag in ("-natPortMap=0", "-autonat=0", "-relay=0"):
            assert flag in arguments, arguments
        network = model.remote_blocks.network
        maddrs = network.run(network.p2p.get_visible_maddrs())
        assert maddrs and all(str(maddr).startswith("/ip4/127.0.0.1/") for maddr in maddrs), maddrs
        assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2).shape == (1, 5)
    finally:
        model.close()


def test_petals_testing_exports_the_loopback_options():
    from petals.network.client import LOOPBACK_CLIENT
    from petals.testing import LOOPBACK_CLIENT as exported

    assert exported is LOOPBACK_CLIENT
    assert "LOOPBACK_CLIENT" in petals.testing.__doc__
