"""(p) What a private swarm costs an inference step: per-token latency, private swarm vs public one.

    python -m benchmarks.private_swarm [--quick] [--results DIR]

Two swarms of the tiny Llama side by side, identical but for membership (``petals.membership``):
the public one of ``latency_tiny_llama`` (2 servers x 4 blocks) and a private one (its own
``petals dht --swarm_authority``, 2 servers with server certificates, a client with a client
certificate). One client per swarm, taking turns, greedy ``generate`` of 64 tokens after a 16-token
prompt; seconds per token include the prefill and opening the session. In the private swarm, every
record is signed and checked, every RPC (the pushes between the servers too) passes the servers'
admission check. Goal: private / public <= 1.02 (issue 24).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from benchmarks.harness import (
    SERVER_ARGS,
    TRACING_SERVERS,
    Check,
    Context,
    Result,
    block_ranges,
    interleaved,
    main,
    summary,
)

GOAL = 1.02
SERVERS = 2


def private_swarm_latency(ctx: Context) -> Result:
    from petals import AutoDistributedModelForCausalLM
    from petals.server.server import READY_MESSAGE
    from petals.testing.swarm import LOOPBACK_CLIENT, start_dht, start_server

    new_tokens, repeats = ctx.pick((64, 7), (4, 1))
    public = ctx.swarm("tiny-llama", SERVERS)
    path, servers = public.model_path, len(public.servers)
    ranges = block_ranges(ctx.num_blocks("tiny-llama"), servers)
    credentials = admit(
        ctx.workdir / "authority", [f"server{index}" for index in range(servers)] + ["client"]
    )
    authority = ["--swarm_authority", credentials["client"]["swarm_authority"]]
    prompt = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(start_dht(*authority))
        processes = [
            stack.enter_context(
                start_server(
                    path,
                    dht.initial_peers,
                    *("--block_indices", blocks, "--torch_dtype", "float32", *SERVER_ARGS),
                    *(
                        word
                        for name, value in credentials[f"server{index}"].items()
                        for word in (f"--{name}", value)
                    ),
                    wait_ready=False,
                    wait_joined=False,
                    env=TRACING_SERVERS,
                )
            )
            for index, blocks in enumerate(ranges)
        ]
        for process in processes:
            process.wait_for_log(READY_MESSAGE, timeout=180)
        private = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT, **credentials["client"]
        )
        stack.callback(private.close)
        clients = {"public": public.client(), "private": private}

        def generate(name: str) -> torch.Tensor:
            with torch.no_grad():
                return clients[name].generate(prompt, attention_mask=torch.ones_like(prompt), **options)

        assert torch.equal(generate("public"), generate("private"))
        samples = interleaved({name: lambda name=name: generate(name) for name in clients}, repeats)
    per_token = {name: summary([value / new_tokens for value in values]) for name, values in samples.items()}
    ratio = per_token["private"]["best"] / per_token["public"]["best"]
    return Result(
        item="p",
        title=f"per-token generation latency, private swarm / public swarm ({servers} servers, tiny Llama)",
        ratio=ratio,
        baseline="the same swarm without membership, same process, taking turns",
        checks=[Check("private / public seconds per token", ratio, GOAL, "<=")],
        measurements={"seconds_per_token": per_token},
        settings={"model": "tiny-llama", "servers": servers, "prompt_tokens": 16, "new_tokens": new_tokens},
        notes=[
            f"per token: public {per_token['public']['best'] * 1e3:.2f} ms, private "
            f"{per_token['private']['best'] * 1e3:.2f} ms (best of {repeats}; medians "
            f"{per_token['public']['median'] * 1e3:.2f} and {per_token['private']['median'] * 1e3:.2f} ms)"
        ],
    )


def admit(directory: Path, names: list[str]) -> dict[str, dict[str, str]]:
    """A new swarm authority in ``directory`` and, for each name, the options that make a member of it."""
    from petals.membership import Certificate, Identity, create_authority, load_authority_key

    public_key = create_authority(directory)
    authority_key = load_authority_key(directory)
    credentials = {}
    for name in names:
        identity = Identity.load_or_create(directory / f"{name}.key")
        role = "client" if name == "client" else "server"
        certificate = Certificate.issue(authority_key, identity.peer_id, role, days=1)
        (directory / f"{name}.cert").write_bytes(certificate.raw)
        credentials[name] = {
            "swarm_authority": str(public_key),
            "membership": str(directory / f"{name}.cert"),
            "identity_path": str(directory / f"{name}.key"),
        }
    return credentials


BENCHMARKS = {"private_swarm": private_swarm_latency}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
