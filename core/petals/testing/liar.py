"""A lying server for tests and benchmarks of ``verify``: an in-process server whose inference steps
come back perturbed. Only a test can make one: it wraps a running ``Server`` object's engine; no
option, environment variable or plugin of a served process reaches this.

    with InProcessServer(model_dir, dht.initial_peers, "--block_indices", "0:4") as server:
        make_liar(server.server, relative=1e-2, every=1)
"""

from __future__ import annotations

from concurrent.futures import Future

import torch


def perturb(output: torch.Tensor, relative: float, generator: torch.Generator) -> torch.Tensor:
    """``output`` plus noise of exactly ``relative`` times its norm at every position."""
    noise = torch.randn(output.shape, generator=generator).to(output.dtype)
    noise = noise / noise.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return output + relative * output.norm(dim=-1, keepdim=True) * noise


def make_liar(server, relative: float = 1e-2, every: int = 1, seed: int = 0) -> list[int]:
    """From now on, every ``every``-th inference step of ``server`` (a started ``Server``) is answered
    perturbed by ``relative`` (``perturb``). Returns the list of the perturbed steps' numbers (1-based),
    which grows as it lies."""
    engine = server.span.engine
    honest = engine.inference_step
    generator = torch.Generator().manual_seed(seed)
    lies: list[int] = []
    steps = 0

    def inference_step(*args, **kwargs) -> Future:
        nonlocal steps
        future = honest(*args, **kwargs)
        steps += 1
        if steps % every:
            return future
        lies.append(steps)
        lying: Future = Future()

        def answer(done: Future) -> None:
            error = done.exception()
            if error is not None:
                lying.set_exception(error)
            else:
                lying.set_result(perturb(done.result(), relative, generator))

        future.add_done_callback(answer)
        return lying

    engine.inference_step = inference_step
    return lies
