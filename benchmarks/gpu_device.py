"""Wheels for running ``benchmarks.gpu`` on a GPU machine that has CUDA torch but not our packages.

    python -m benchmarks.gpu_device            # here: fills .whl/ (git-ignored), prints the device command
    python -m benchmarks.gpu_device --command  # only print it
    python -m benchmarks.gpu_device --command -- --only correctness --json '$OUT/gpu.json'  # a part

The device image (Python 3.12, torch 2.11 with CUDA 13, transformers 5.17, accelerate, pluggy, click, ...)
lacks our pins and hivemind's small dependencies: they travel as wheels, with this repository's own
distributions built here: core, every family of the Makefile's ``FAMILIES`` and the example qwen2
plugin (the ``petals`` entry points find the families only in installed ones). 38 MiB of wheels, 41
MiB with the working tree, under the 64 MiB a call may carry (checked after each build); bitsandbytes'
wheel (43 MB) holds a library for every CUDA version, so it is repacked with the CPU and CUDA 13.0 ones
alone (under 4 MB). On the device, the command installs the wheels into ``.gpu-site`` (git-ignored,
kept between the calls of a warm machine) and runs the check, its log and JSON in ``$OUT``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
# what the device image lacks or holds in another version than our pins (its list: the device docs)
PINNED = [
    "hivemind==1.1.12",
    "transformers==5.24.0",
    "huggingface-hub==2.4.0",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "click==8.5.1",
    "pluggy==1.7.0",
    "msgpack==1.2.4",
    "protobuf==7.36.2",
    "base58==2.1.1",
    "configargparse==1.9.0",
    "cryptography==50.0.2",
    "cffi==2.1.1",
    "pycparser==3.12",
    "py-cid==0.5.0",
    "py-multihash==3.0.0",
    "blake3==1.0.11",
    "mmh3==5.3.1",
    "py-multibase==2.0.0",
    "py-multicodec==1.0.0",
    "morphys==1.0",
    "netaddr==1.3.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "tensor-parallel==2.0.0",
    "gguf==0.19.0",
]
SOURCE_ONLY = ["prefetch-generator==1.0.3", "python-baseconv==1.2.2", "varint==1.0.2"]  # pure Python sdists
BITSANDBYTES = "bitsandbytes==0.50.2"
KEEP_LIBRARIES = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so")
# what the checks import on the device besides the families of the Makefile's FAMILIES
OWN_BESIDES_FAMILIES = ["core", "plugins/petals_qwen2"]
CARRY_LIMIT = 64 * 2**20  # bytes a device call carries: the working tree and .whl together
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "any"]
PLATFORM += [f"--platform=manylinux_2_{n}_x86_64" for n in (5, 17, 24, 27, 28, 31, 34, 35)]
PLATFORM += ["--platform=manylinux2014_x86_64", "--platform=manylinux1_x86_64"]
GPU_ARGS = "--json $OUT/gpu.json --budget 400"


def device_command(gpu_args: str = GPU_ARGS) -> str:
    """The device's command: install the wheels once per machine, then ``benchmarks.gpu`` with ``gpu_args``."""
    return (
        "[ -f .gpu-site/.ready ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
        "--upgrade --target .gpu-site .whl/*.whl && touch .gpu-site/.ready; } && "
        "export PYTHONPATH=$PWD/.gpu-site PYTHONUNBUFFERED=1 && set -o pipefail && nvidia-smi -L && "
        f"timeout 500 python3 -m benchmarks.gpu {gpu_args} 2>&1 | tee $OUT/log"
    )


def own_distributions() -> list[str]:
    """This repository's distributions the device needs: core, every family the Makefile installs
    (``FAMILIES``), and the example qwen2 plugin."""
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (line,) = [line for line in makefile.splitlines() if line.startswith("FAMILIES :=")]
    return [*OWN_BESIDES_FAMILIES, *line.removeprefix("FAMILIES :=").split()]


def carried_bytes() -> int:
    """What a device call carries with ``.whl``: the working tree's files (as git lists them) and the wheels."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    tree = sum(
        (ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file()
    )
    return tree + sum(path.stat().st_size for path in WHEELS.glob("*.whl"))


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(dest: Path) -> None:
    pip("download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM, "-d", str(dest), *PINNED)
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), *SOURCE_ONLY)


def bitsandbytes(dest: Path) -> Path:
    """bitsandbytes' wheel with the CPU and CUDA 13.0 libraries only (and its RECORD to match)."""
    with tempfile.TemporaryDirectory() as folder:
        pip("download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM, "-d", folder, BITSANDBYTES)
        (source,) = Path(folder).glob("bitsandbytes-*.whl")
        target = dest / source.name
        with zipfile.ZipFile(source) as wheel, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
            dropped = {
                name
                for name in wheel.namelist()
                if name.endswith(".so") and Path(name).name not in KEEP_LIBRARIES
            }
            for name in wheel.namelist():
                if name in dropped:
                    continue
                data = wheel.read(name)
                if name.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if line.split(",")[0] not in dropped).encode()
                out.writestr(name, data)
    return target


def build_own(dest: Path) -> None:
    """This repository's distributions as wheels (rebuild after every change: the device runs these)."""
    for stale in [*dest.glob("petals_*.whl"), *dest.glob("petals-*.whl")]:
        stale.unlink()
    pip(
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(dest),
        *(str(ROOT / name) for name in own_distributions()),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--command", action="store_true", help="only print the device command")
    parser.add_argument("--own", action="store_true", help="only rebuild this repository's wheels")
    parser.add_argument(
        "gpu_args", nargs=argparse.REMAINDER, help=f"benchmarks.gpu's arguments after --; default: {GPU_ARGS}"
    )
    args = parser.parse_args(argv)
    gpu_args = " ".join(arg for arg in args.gpu_args if arg != "--") or GPU_ARGS
    if not args.command:
        WHEELS.mkdir(exist_ok=True)
        if not args.own:
            download(WHEELS)
            bitsandbytes(WHEELS)
        build_own(WHEELS)
        wheels = sum(path.stat().st_size for path in WHEELS.glob("*.whl"))
        carried = carried_bytes()
        print(
            f"{len(list(WHEELS.glob('*.whl')))} wheels, {wheels / 2**20:.1f} MiB in {WHEELS}; carried with the"
        )
        print(
            f"working tree: {carried / 2**20:.1f} MiB of the {CARRY_LIMIT / 2**20:.0f} MiB a device call carries"
        )
        if carried > CARRY_LIMIT:
            print(
                "over the limit: drop what the run does not need from .whl or the working tree",
                file=sys.stderr,
            )
            return 1
    print(device_command(gpu_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
