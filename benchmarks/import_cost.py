"""What each group of a server's imports adds to a fresh process: private memory (USS) and seconds.

    python -m benchmarks.import_cost [--unpatched]

A diagnostic, not part of the suite. One fresh Python process imports, in the order ``petals serve``
meets them, what a tiny-Llama server imports, and prints what each group adds given the ones before
it. ``--unpatched`` keeps only the hivemind import patch of ``petals.patches`` (as before the
torch._dynamo and scipy.optimize ones, and before ``petals serve`` kept transformers from importing
torch.distributed's DTensor, FSDP and sympy), for comparison in the same session. Seconds on a shared
machine are noise; the memory is not.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time

MIB = 2**20

# (what, modules), in the order a server imports them
GROUPS = (
    ("interpreter, click, petals.cli.run_server", ("petals.cli.run_server",)),
    ("torch", ("torch",)),
    ("transformers (top level)", ("transformers",)),
    ("sympy (torch's symbolic shapes)", ("sympy",)),  # the next group imports it
    ("torch.distributed.tensor, fsdp", ("torch.distributed.tensor", "torch.distributed.fsdp")),
    ("transformers' loading code", ("transformers.core_model_loading", "transformers.modeling_utils")),
    ("transformers.masking_utils", ("transformers.masking_utils",)),
    ("modeling_llama (the family's layers)", ("transformers.models.llama.modeling_llama",)),
    ("hivemind (dht, p2p)", ("hivemind.dht", "hivemind.p2p")),
    ("petals server", ("petals.server.server", "petals.server.throughput", "petals_llama.block")),
)
# what a server no longer imports: petals serve starts with without_torch_distributed (with transformers)
UNPATCHED_ONLY = {"sympy (torch's symbolic shapes)", "torch.distributed.tensor, fsdp"}
WATCHED = ("torch._dynamo.convert_frame", "scipy.optimize._optimize", "sympy", "torch.distributed.tensor")


def measure(unpatched: bool) -> None:
    import psutil

    from petals import patches

    if unpatched:
        sys.meta_path[:] = [
            finder for finder in sys.meta_path if type(finder).__name__ != "_ImportPatchFinder"
        ]
        patches.install_import_patches([patches.LAZY_HIVEMIND])
    process = psutil.Process()
    before = process.memory_full_info().uss
    total_seconds = 0.0
    for what, modules in GROUPS:
        if what in UNPATCHED_ONLY and not unpatched:
            continue
        started, count = time.perf_counter(), len(sys.modules)
        if what == "transformers (top level)" and not unpatched:
            patches.without_torch_distributed()
        for module in modules:
            importlib.import_module(module)
        seconds = time.perf_counter() - started
        total_seconds += seconds
        now = process.memory_full_info().uss
        print(
            f"  {what:42s} {(now - before) / MIB:7.1f} MiB {seconds:6.2f} s {len(sys.modules) - count:5d} modules"
        )
        before = now
    print(f"  {'total':42s} {now / MIB:7.1f} MiB {total_seconds:6.2f} s {len(sys.modules):5d} modules")
    print("  imported: " + ", ".join(f"{name} {'yes' if name in sys.modules else 'no'}" for name in WATCHED))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unpatched", action="store_true", help="only the hivemind import patch")
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args()
    if args.here:
        measure(args.unpatched)
        return
    print("import patches:", "hivemind only" if args.unpatched else "all")
    command = [sys.executable, "-m", "benchmarks.import_cost", "--here"]
    subprocess.run(command + (["--unpatched"] if args.unpatched else []), check=True)


if __name__ == "__main__":
    main()
