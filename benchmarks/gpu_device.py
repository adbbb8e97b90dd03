"""Wheels for running ``benchmarks.gpu`` on a GPU machine that has CUDA torch but not our packages.

    python -m benchmarks.gpu_device            # here: fills .whl/ (git-ignored), prints the device command
    python -m benchmarks.gpu_device --command  # only print it

The device image (Python 3.12, torch 2.11 with CUDA 13, transformers 5.17, accelerate, pluggy, click, ...)
lacks our pins and hivemind's small dependencies: they travel as wheels, with this repository's own
distributions built here (the ``petals`` entry points find the families only in installed ones).
About 40 MB with the working tree, under the 64 MiB a call may carry; bitsandbytes' wheel (43 MB) holds a
library for every CUDA version, so it is repacked with the CPU and CUDA 13.0 ones alone (under 2 MB).
On the device, the command installs the wheels into ``.gpu-site`` (git-ignored, kept between the calls
of a warm machine) and runs the check, its log and JSON in ``$OUT``.
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
OWN = [
    "core",
    "petals_llama",
    "petals_bloom",
    "petals_falcon",
    "petals_mixtral",
    "petals_deepseek",
    "petals_qwen",
    "petals_gemma",
    "petals_mistral",
    "petals_gpt_oss",
    "petals_glm",
    "petals_olmo",
    "petals_phi",
    "petals_granite",
    "petals_cohere",
    "petals_exaone",
    "petals_ernie",
    "petals_dots",
    "petals_minimax",
    "petals_lfm",
    "plugins/petals_qwen2",
]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "any"]
PLATFORM += [f"--platform=manylinux_2_{n}_x86_64" for n in (5, 17, 24, 27, 28, 31, 34, 35)]
PLATFORM += ["--platform=manylinux2014_x86_64", "--platform=manylinux1_x86_64"]
COMMAND = (
    "[ -f .gpu-site/.ready ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
    "--upgrade --target .gpu-site .whl/*.whl && touch .gpu-site/.ready; } && "
    "export PYTHONPATH=$PWD/.gpu-site PYTHONUNBUFFERED=1 && set -o pipefail && nvidia-smi -L && "
    "timeout 500 python3 -m benchmarks.gpu --json $OUT/gpu.json --budget 400 2>&1 | tee $OUT/log"
)


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
        *(str(ROOT / name) for name in OWN),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--command", action="store_true", help="only print the device command")
    parser.add_argument("--own", action="store_true", help="only rebuild this repository's wheels")
    args = parser.parse_args(argv)
    if not args.command:
        WHEELS.mkdir(exist_ok=True)
        if not args.own:
            download(WHEELS)
            bitsandbytes(WHEELS)
        build_own(WHEELS)
        size = sum(path.stat().st_size for path in WHEELS.glob("*.whl"))
        print(f"{len(list(WHEELS.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {WHEELS}")
    print(COMMAND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
