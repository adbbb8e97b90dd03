"""``make image-test``: build the images in deploy/ and run one in a real swarm on this machine.

1. A Debian bookworm base image, built once (``debootstrap --variant=minbase`` from the Debian
   mirror apt uses here, then ``podman import``) and reused while it exists.
2. ``deploy/Dockerfile.cpu`` and ``deploy/Dockerfile.cuda`` built on it by ``podman build
   --isolation chroot`` (no container runtime needed). pip in the build takes this machine's own
   settings (``pip config list``): as a build secret, with the local folders they name mounted
   read-only for the build only. The CUDA image gets the CUDA torch wheel from those indexes when
   they offer one, else the CPU wheel (every other step still runs).
3. Each image's configuration (command, volume, environment, user, stop signal) and file system (no
   compiler, no installer, no sources) are checked, and its default command is run.
4. A swarm on 127.0.0.1: a bootstrap peer and a server for blocks 0:15 of the demo model on the host,
   and a ``petals serve`` for blocks 15:30 started from the CPU image's own file system, user,
   environment and command (``chroot_run.py``: read-only root, tmpfs on /tmp, a cache volume),
   configured through ``PETALS_*`` variables. A greedy generation of the demo's question through
   both equals the model's answer in one process. Then the image's stop signal: the server must
   announce OFFLINE and exit 0 within 5 s.

Every process is stopped through its own handle and every mount undone, also on failure.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch

    from petals.local_swarm import ServerProcess

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
WORK = REPO / "build" / "image-test"  # logs, the build's pip settings, volumes (git-ignored)
SUITE = "bookworm"  # python:3.11-slim's Debian, whose python3 is 3.11 too
BASE_IMAGE = f"localhost/petals-core-base:{SUITE}"
# python3-venv: what python:3.11-slim has beyond a minimal Debian; passwd: useradd
BASE_PACKAGES = "python3-venv,passwd"
CPU_IMAGE = "localhost/petals-core:cpu"
CUDA_IMAGE = "localhost/petals-core:cuda"
# the public release only: a local build such as 2.13.0+cpu in a find-links folder does not match
CUDA_TORCH = "torch===2.13.0"
CPU_TORCH = "torch==2.13.0"
BUILD_TOOLS = ("gcc", "cc", "c++", "make", "ld", "pip", "pip3")
STOP_SECONDS = 5
SPLIT = "15"  # the host serves blocks 0:15 of the demo model's 30, the image 15:30
IMAGE_BLOCKS = f"{SPLIT}:30"
DEMO_MAX_NEW_TOKENS = 48  # petals demo's default


class ImageTestError(RuntimeError):
    """A step failed; the message says which and what was seen."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the images in deploy/ and run one in a local swarm.")
    parser.add_argument("--rebuild-base", action="store_true", help="Build the Debian base image again.")
    parser.add_argument("--no-cuda", action="store_true", help="Skip deploy/Dockerfile.cuda.")
    args = parser.parse_args(argv)
    started = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        for tool in ("podman", "debootstrap"):
            if shutil.which(tool) is None:
                raise ImageTestError(f"{tool} is not installed: run `make image-test`, which installs it")
        base = base_image(rebuild=args.rebuild_base)
        with build_pip_settings() as pip:
            cpu = build(REPO / "deploy/Dockerfile.cpu", CPU_IMAGE, base, pip, CPU_TORCH)
            cuda = None if args.no_cuda else build_cuda(base, pip)
        check_image(cpu, "import torch; print('torch', torch.__version__)")
        if cuda:
            check_image(
                cuda,
                "import torch, bitsandbytes, peft; print('torch', torch.__version__, 'CUDA', torch.version.cuda)",
            )
        check_swarm(cpu)
    except ImageTestError as error:
        say(f"\nimage-test FAILED: {error}")
        return 1
    say("")
    for image in filter(None, (cpu, cuda)):
        say(f"{image.tag}: {image.size / 1e9:.2f} GB{' (' + image.note + ')' if image.note else ''}")
    say(f"image-test passed in {time.monotonic() - started:.0f} s")
    return 0


def say(message: str) -> None:
    print(message, flush=True)


# ---- processes --------------------------------------------------------------------------------


def run(command: Sequence[str], log: Path, show: Callable[[str], bool] = lambda line: False) -> None:
    """Run ``command`` with its output in ``log``, printing the lines ``show`` picks (progress)."""
    say(f"$ {' '.join(command)}")
    started = time.monotonic()
    with open(log, "a") as sink:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in process.stdout:
                sink.write(line)
                if show(line):
                    say(f"  [{time.monotonic() - started:5.0f} s] {line.rstrip()[:150]}")
            process.wait()
        finally:
            stop_process(process)
    if process.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise ImageTestError(
            f"{command[0]} {command[1]} exited with {process.returncode} (log: {log}):\n{tail}"
        )


def stop_process(process: subprocess.Popen) -> None:
    """SIGINT (podman and debootstrap clean up after it), SIGKILL if that takes over 60 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def podman(*args: str) -> str:
    result = subprocess.run(["podman", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise ImageTestError(f"podman {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


# ---- the base image ---------------------------------------------------------------------------


def base_image(rebuild: bool) -> str:
    """A minimal Debian with Python 3.11 and venv, as an image; built once, then reused."""
    exists = subprocess.run(["podman", "image", "exists", BASE_IMAGE]).returncode == 0
    if exists and not rebuild:
        say(f"Base image {BASE_IMAGE}: cached (--rebuild-base builds it again)")
        return BASE_IMAGE
    mirror = debian_mirror()
    say(f"Building base image {BASE_IMAGE}: debootstrap {SUITE} from {mirror} (a few minutes, once)")
    with tempfile.TemporaryDirectory(dir=WORK, prefix="rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        command = [
            "debootstrap",
            "--variant=minbase",
            f"--include={BASE_PACKAGES}",
            SUITE,
            str(rootfs),
            mirror,
        ]
        try:
            milestones = (
                "I: Retrieving InRelease",
                "I: Installing core",
                "I: Unpacking the base",
                "I: Base system",
            )
            run(command, WORK / "debootstrap.log", show=lambda line: line.startswith(milestones))
        finally:
            unmount_below(rootfs)  # debootstrap mounts /proc and /sys inside while it installs
        # no downloaded packages, no package lists, and no mirror of this machine in the image
        for leftover in [*rootfs.glob("var/cache/apt/archives/*.deb"), *rootfs.glob("var/lib/apt/lists/*")]:
            if leftover.is_file():
                leftover.unlink()
        (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(
                [
                    "podman",
                    "import",
                    "--change",
                    "ENV LANG=C.UTF-8",
                    "--change",
                    'CMD ["python3"]',
                    "-",
                    BASE_IMAGE,
                ],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
            )
        finally:
            tar.stdout.close()
            stop_process(tar)
        if imported.returncode != 0 or tar.returncode != 0:
            raise ImageTestError(f"podman import failed: {imported.stderr.strip()}")
    return BASE_IMAGE


def debian_mirror() -> str:
    """The mirror apt uses here for the suite (deb822 ``.sources`` or one-line ``.list`` files)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        if path.suffix == ".sources":
            for stanza in path.read_text().split("\n\n"):
                fields = {}
                for line in stanza.splitlines():
                    name, colon, value = line.partition(":")
                    if colon and not line.startswith(("#", " ")):
                        fields[name.strip()] = value.split()
                if "deb" in fields.get("Types", []) and SUITE in fields.get("Suites", []):
                    return fields["URIs"][0]
        elif path.name == "sources.list" or path.suffix == ".list":
            for line in path.read_text().splitlines() if path.is_file() else []:
                words = [word for word in line.split("#")[0].split() if not word.startswith("[")]
                if words[:1] == ["deb"] and len(words) >= 3 and words[2] == SUITE:
                    return words[1]
    raise ImageTestError(f"no Debian {SUITE} mirror in /etc/apt/sources.list(.d): debootstrap needs one")


def unmount_below(path: Path) -> None:
    """Unmount whatever is mounted inside ``path``, innermost first."""
    prefix = f"{path.resolve()}/"
    mounted = [
        line.split()[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
    ]
    for target in sorted((m for m in mounted if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", target], check=False)


# ---- building ---------------------------------------------------------------------------------


@dataclass
class PipSettings:
    config_file: Path  # a pip.conf with this machine's settings, handed to the build as a secret
    mounts: list[str]  # local folders and files they name, bound read-only into the build


INDEX_KEYS = {"index-url", "extra-index-url"}


@contextlib.contextmanager
def build_pip_settings() -> Iterator[PipSettings]:
    """This machine's pip settings (files and ``PIP_*``, as ``pip config list`` shows them) for builds.

    Nothing of them is written into a Dockerfile or an image: the secret and the mounts exist only
    while a RUN step runs. A local index is mounted with its parent folder, where a simple index's
    relative file links point (``simple/NAME/`` links to ``../../files/...``).
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    sections: dict[str, dict[str, str]] = {}
    for line in sorted(listed.splitlines(), key=lambda line: line.startswith(":env:")):  # env wins
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        section = "global" if section == ":env:" else section
        sections.setdefault(section, {})[name] = ast.literal_eval(value)
    mounts: set[Path] = set()
    for section in sections.values():
        for name, value in section.items():
            for word in value.split():
                path = Path(urlparse(word).path) if word.startswith("file:") else Path(word)
                if path.is_absolute() and path.exists():
                    mounts.add(path.parent if name in INDEX_KEYS and path.parent != Path("/") else path)
    outermost = sorted(m for m in mounts if not any(other in m.parents for other in mounts))
    text = "".join(
        f"[{section}]\n" + "".join(f"{name} = {value}\n" for name, value in values.items())
        for section, values in sections.items()
    )
    with tempfile.TemporaryDirectory(dir=WORK, prefix="pip-") as folder:
        config_file = Path(folder) / "pip.conf"
        config_file.write_text(text)
        yield PipSettings(config_file, [str(path) for path in outermost])


@dataclass
class Image:
    tag: str
    config: dict  # the OCI image config: Cmd, Entrypoint, Env, User, WorkingDir, Volumes, StopSignal
    size: int
    note: str = ""


def build(dockerfile: Path, tag: str, base: str, pip: PipSettings, torch: str) -> Image:
    say(f"\nBuilding {tag} from {dockerfile.relative_to(REPO)} on {base} ({torch})")
    started = time.monotonic()
    command = [
        "podman", "build", "--isolation", "chroot", "--file", str(dockerfile), "--tag", tag,
        "--build-arg", f"BASE={base}", "--build-arg", "TORCH_INDEX=", "--build-arg", f"TORCH={torch}",
        "--secret", f"id=pip.conf,src={pip.config_file}",
        *(f"--volume={path}:{path}:ro" for path in pip.mounts),
        str(REPO),
    ]  # fmt: skip
    log = WORK / f"build-{tag.rsplit(':', 1)[1]}.log"
    log.write_text("")
    previous = image_id(tag)
    run(command, log, show=lambda line: " STEP " in line or line.startswith("Successfully tagged"))
    image = inspect(tag)
    if previous not in (None, image_id(tag)):  # the image this build replaced, now untagged: GBs
        subprocess.run(["podman", "rmi", previous], capture_output=True)
    say(
        f"Built {tag} in {time.monotonic() - started:.0f} s: {image.size / 1e9:.2f} GB ({image.size / 2**20:,.0f} MiB)"
    )
    return image


def build_cuda(base: str, pip: PipSettings) -> Image:
    """With the CUDA torch wheel from the configured indexes; where none is offered, the CPU wheel."""
    try:
        return build(REPO / "deploy/Dockerfile.cuda", CUDA_IMAGE, base, pip, CUDA_TORCH)
    except ImageTestError as error:
        steps = [line for line in (WORK / "build-cuda.log").read_text().splitlines() if " STEP " in line]
        if not steps or '"$TORCH"' not in steps[-1]:
            raise  # a later step failed: the CPU wheel would not help
        reason = str(error).strip().splitlines()[-1]
        say(f"No CUDA torch wheel could be installed ({reason}); building with the CPU wheel instead")
        image = build(REPO / "deploy/Dockerfile.cuda", CUDA_IMAGE, base, pip, CPU_TORCH)
        image.note = "built with the CPU torch wheel"
        return image


def image_id(tag: str) -> str | None:
    result = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else None


def inspect(tag: str) -> Image:
    (data,) = json.loads(podman("image", "inspect", tag))
    return Image(tag, data["Config"], data["Size"])


# ---- running from an image --------------------------------------------------------------------


@contextlib.contextmanager
def mounted(image: Image) -> Iterator[Path]:
    """The image's root file system, read-only (``podman image mount``), unmounted on exit."""
    root = Path(podman("image", "mount", image.tag).strip())
    try:
        yield root
    finally:
        podman("image", "unmount", image.tag)


def in_image(
    image: Image,
    root: Path,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    volumes: dict[Path, str] | None = None,
) -> list[str]:
    """``chroot_run.py``'s arguments to start ``args`` (default: the image's command) as ``docker run
    --read-only --tmpfs /tmp -v HOST:PATH -e NAME=VALUE IMAGE ARGS`` would."""
    config = image.config
    command = [*(config.get("Entrypoint") or []), *(args or config.get("Cmd") or [])]
    environment = dict(item.split("=", 1) for item in config.get("Env") or [])
    environment.update(env or {})
    return [
        "--root", str(root), "--user", config.get("User") or "root", "--workdir", config.get("WorkingDir") or "/",
        *(f"--env={name}={value}" for name, value in environment.items()),
        *(f"--volume={source}:{target}" for source, target in (volumes or {}).items()),
        "--tmpfs", "/tmp", "--", *command,
    ]  # fmt: skip


def run_in_image(image: Image, root: Path, *args: str, timeout: float = 300) -> str:
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "chroot_run.py"), *in_image(image, root, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        what = " ".join(args) or "the default command"
        raise ImageTestError(
            f"{what} in {image.tag} exited with {result.returncode}:\n{result.stdout}{result.stderr}"
        )
    return result.stdout


# ---- checks -----------------------------------------------------------------------------------


def check(condition: bool, what: str) -> None:
    if not condition:
        raise ImageTestError(what)
    say(f"  ok: {what}")


def image_user(root: Path, user: str) -> int:
    name = user.partition(":")[0]
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if name in (fields[0], fields[2]):
            return int(fields[2])
    raise ImageTestError(f"the image's user {user!r} is not in its /etc/passwd")


def check_image(image: Image, probe: str) -> None:
    """What the README promises of an image: its configuration, its file system, its default command."""
    say(f"\nChecking {image.tag} ({image.size / 1e9:.2f} GB{', ' + image.note if image.note else ''})")
    check_config(image.config)
    with mounted(image) as root:
        check_file_system(image.config, root)
        usage = run_in_image(image, root)
        check("Usage: petals serve" in usage, "its default command runs (petals serve --help, exit 0)")
        say(f"  {run_in_image(image, root, 'python3', '-c', probe).strip()}")


def check_config(config: dict) -> None:
    """An image's configuration (``podman image inspect``'s Config): command, volume, environment, stop signal."""
    environment = dict(item.split("=", 1) for item in config.get("Env") or [])
    default_command = config.get("Cmd") == ["petals", "serve", "--help"] and not config.get("Entrypoint")
    check(default_command, "default command: petals serve --help")
    check("/cache" in (config.get("Volumes") or {}), "a volume at /cache")
    in_volume = environment.get("PETALS_CACHE") == "/cache" and environment.get("HF_HOME", "").startswith(
        "/cache/"
    )
    check(in_volume, "PETALS_CACHE=/cache, HF_HOME inside it")
    check(config.get("StopSignal") == "SIGTERM", "stop signal SIGTERM")


def check_file_system(config: dict, root: Path) -> None:
    """An image's root file system at ``root``: its user is not root, no build tools, no sources."""
    environment = dict(item.split("=", 1) for item in config.get("Env") or [])
    uid = image_user(root, config.get("User") or "root")
    check(uid != 0, f"runs as user {config.get('User')} (uid {uid}), not root")
    path = environment.get("PATH", "").split(":")
    found = [
        f"{folder}/{tool}"
        for tool in BUILD_TOOLS
        for folder in path
        if (root / folder.lstrip("/") / tool).exists()
    ]
    check(
        not found,
        f"no build tools on its PATH ({', '.join(BUILD_TOOLS)}){': found ' + ', '.join(found) if found else ''}",
    )
    check(not (root / "src").exists(), "no sources (the build stage's /src stays behind)")


def check_swarm(image: Image) -> None:
    """The demo model split between a server on the host and one started from ``image``."""
    from transformers.utils import logging as transformers_logging

    from petals.demo_model import prepare_demo_model
    from petals.local_swarm import SwarmProcessError, start_dht, start_server
    from petals.server.server import READY_MESSAGE

    transformers_logging.disable_progress_bar()  # one line per step here, not a bar per load
    say(f"\nA swarm on 127.0.0.1: blocks 0:{SPLIT} on the host, {SPLIT}:30 from {image.tag}")
    model = prepare_demo_model(WORK / "models")
    # readable by the image's user: the prepared folder comes from mkdtemp (mode 0700)
    subprocess.run(["chmod", "-R", "a+rX", str(model)], check=True)
    volume = Path(tempfile.mkdtemp(dir=WORK, prefix="cache-volume-"))
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, volume, ignore_errors=True)
            root = stack.enter_context(mounted(image))
            dht = stack.enter_context(start_dht())
            host_blocks = ("--block_indices", f"0:{SPLIT}", "--torch_dtype", "float32")
            host = stack.enter_context(start_server(model, dht.initial_peers, *host_blocks, wait_ready=False))
            # the prepared folder links the GGUF file where pip put it, outside the image: the image's
            # volume gets the folder as a user would copy it, the file itself in it
            copied = Path(tempfile.mkdtemp(dir=WORK, prefix="image-model-"))
            stack.callback(shutil.rmtree, copied, ignore_errors=True)
            shutil.copytree(model, copied / model.name)  # symlinks=False: what they point to
            subprocess.run(["chmod", "-R", "a+rX", str(copied)], check=True)
            served = stack.enter_context(
                start_image_server(image, root, copied / model.name, volume, dht.initial_peers)
            )
            host.wait_for_log(READY_MESSAGE, timeout=300)
            say(f"  both servers ONLINE: host ...{host.peer_id[-8:]}, image ...{served.peer_id[-8:]}")
            check_generation(model, dht.initial_peers, {host.peer_id, served.peer_id})
            check_stop(image.config["StopSignal"], served, model, dht.initial_peers, IMAGE_BLOCKS)
    except SwarmProcessError as error:
        raise ImageTestError(str(error)) from None


def start_image_server(
    image: Image, root: Path, model: Path, volume: Path, initial_peers: list[str]
) -> ServerProcess:
    """``docker run -v VOLUME:/cache -e PETALS_...=... IMAGE petals serve /cache/MODEL --loopback``
    with the model bound inside the volume; checks the user, the settings and the volume."""
    from petals.local_swarm import ServerProcess

    uid = image_user(root, image.config["User"])
    os.chown(volume, uid, uid)  # as docker fills a new named volume from the image's /cache
    (volume / model.name).mkdir()  # the model's mount point inside the volume
    settings = server_settings(initial_peers, IMAGE_BLOCKS)
    in_volume = f"/cache/{model.name}"
    arguments = in_image(
        image,
        root,
        ["petals", "serve", in_volume, "--loopback"],
        settings,
        {volume: "/cache", model: in_volume},
    )
    say(
        f"  the image's server: petals serve {in_volume} --loopback, "
        + " ".join(f"{k}={v}" for k, v in settings.items())
    )
    served = ServerProcess(
        f"petals serve from {image.tag}", ["chroot_run", *arguments], env={"PYTHONPATH": str(DEPLOY)}
    )
    return checked_server(served, uid, volume, IMAGE_BLOCKS)


def server_settings(initial_peers: list[str], blocks: str) -> dict[str, str]:
    """What the image's server is configured with: ``PETALS_*`` variables only, as ``docker run -e``."""
    return {
        "PETALS_INITIAL_PEERS": " ".join(initial_peers),
        "PETALS_BLOCK_INDICES": blocks,
        "PETALS_TORCH_DTYPE": "float32",
    }


def checked_server(served: ServerProcess, uid: int, volume: Path, blocks: str) -> ServerProcess:
    """``served`` once ONLINE, checked: it runs as ``uid``, serves ``blocks`` in float32 as its
    ``server_settings`` said, and keeps its throughput measurement in ``volume`` (its /cache)."""
    import psutil

    from petals.server.server import READY_MESSAGE
    from petals.server.throughput import CACHE_FILE

    try:
        served.timeout = 300  # ``peer_id`` waits this long for the line saying it joined (a cold start)
        served.wait_for_log("Joined the swarm", timeout=served.timeout)
        ready = served.wait_for_log(READY_MESSAGE, timeout=300)
        check(psutil.Process(served.pid).uids().real == uid, f"the image's server runs as uid {uid}")
        check(
            f"blocks {blocks}, float32" in ready,
            "it serves the blocks and dtype that PETALS_BLOCK_INDICES and PETALS_TORCH_DTYPE set",
        )
        cache_file = volume / CACHE_FILE
        check(
            cache_file.is_file() and cache_file.stat().st_uid == uid,
            f"its throughput measurement went into the /cache volume ({CACHE_FILE}, owned by uid {uid})",
        )
    except BaseException:
        served.stop()
        raise
    return served


def check_generation(model: Path, initial_peers: list[str], servers: set[str], chat: bool = True) -> None:
    """The demo's question, greedy, through the swarm: token for token the model's answer in one process
    (``chat``: in the model's chat template, as the demo asks it)."""
    import torch
    from transformers import AutoTokenizer

    from petals import AutoDistributedModelForCausalLM
    from petals.cli.demo import QUESTION
    from petals.cli.generate import encode
    from petals.network.client import LOOPBACK_CLIENT

    tokenizer = AutoTokenizer.from_pretrained(model)
    inputs = encode(tokenizer, QUESTION, chat=chat)
    expected = reference_answer(model, inputs)
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        model, initial_peers=initial_peers, **LOOPBACK_CLIENT
    )
    try:
        got = remote.generate(**inputs, max_new_tokens=DEMO_MAX_NEW_TOKENS, do_sample=False)
        route = {span.peer_id.to_base58() for span in remote.remote_blocks.manager.spans.values()}
    finally:
        remote.remote_blocks.network.close()
    prompt_length = inputs["input_ids"].shape[1]
    say(f"  Q: {QUESTION}\n  A: {tokenizer.decode(got[0, prompt_length:], skip_special_tokens=True)}")
    check(route == servers, "the generation went through both servers")
    check(
        torch.equal(got, expected),
        f"its {got.shape[1] - prompt_length} tokens equal the model's greedy answer in one process",
    )


def reference_answer(model: Path, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The demo's greedy answer from plain transformers in this process: the model folder holds a GGUF
    file (as the demo prepares it) or a Hugging Face checkpoint."""
    import torch

    from petals.formats.gguf import local_model

    local = local_model(model, dtype=torch.float32)
    with torch.inference_mode():
        return local.generate(**inputs, max_new_tokens=DEMO_MAX_NEW_TOKENS, do_sample=False)


def check_stop(
    stop_signal_name: str, served: ServerProcess, model: Path, initial_peers: list[str], blocks: str
) -> None:
    """The image's stop signal (what ``docker stop`` sends): OFFLINE announced, exit 0 within 5 s."""
    import psutil

    from petals import AutoDistributedConfig
    from petals.data_structures import ServerState
    from petals.testing.wire_client import WireClient

    stop_signal = signal.Signals[stop_signal_name]
    peer_id = served.peer_id  # while it runs: read from its log
    daemons = psutil.Process(served.pid).children()
    sent = time.monotonic()
    served.process.send_signal(stop_signal)
    try:
        code = served.process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        raise ImageTestError(
            f"the image's server still runs {STOP_SECONDS} s after {stop_signal.name}"
        ) from None
    seconds = time.monotonic() - sent
    served.stop()  # joins its log readers
    check(code == 0, f"{stop_signal.name} (the image's STOPSIGNAL): exit code {code} after {seconds:.2f} s")
    check(f"Announced OFFLINE for blocks {blocks}" in served.log, "it announced OFFLINE before leaving")
    client = WireClient(initial_peers)
    try:
        prefix = AutoDistributedConfig.from_pretrained(model).dht_prefix
        record = client.dht_get(f"{prefix}.{blocks.partition(':')[0]}").value[peer_id].value
    finally:
        client.close()
    check(ServerState(record[0]) == ServerState.OFFLINE, "the DHT lists it as OFFLINE")
    _, alive = psutil.wait_procs(daemons, timeout=5)
    check(not alive, "its p2p daemon is gone too")


if __name__ == "__main__":
    sys.exit(main())
