"""Run a command from a container image's mounted root file system, as ``docker run`` would start it.

For machines where no container runtime can start containers (``make image-test`` here: ``podman run``
ends in crun's "setrlimit RLIMIT_NOFILE: Operation not permitted"). ``deploy/image_test.py`` mounts the image (``podman image mount``, read-only) and
starts this module, which

- enters a mount namespace of its own, so that every mount below disappears with its last process
  (nothing to unmount, even after SIGKILL);
- mounts /proc, binds /dev and /sys, a tmpfs on each ``--tmpfs`` path and each ``--volume``;
- chroots into the image, changes to ``--workdir``, becomes ``--user`` (as the image's /etc/passwd
  and /etc/group name it) and execs the command with exactly the environment given.

The exec keeps this process's pid: a signal sent to it reaches the image's command itself, as
``docker stop`` signals the container's first process. The network is the host's (loopback included).

    python chroot_run.py --root MOUNT --user petals --workdir /home/petals --env PATH=... \\
        --volume /host/cache:/cache --tmpfs /tmp -- petals serve --help
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
from pathlib import Path

CLONE_NEWNS = 0x00020000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="The image's mounted root file system.")
    parser.add_argument("--user", default="root", help="NAME, UID or UID:GID, as an image's User.")
    parser.add_argument("--workdir", default="/")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE; nothing else is passed.")
    parser.add_argument("--volume", action="append", default=[], help="HOST_DIR:PATH, bound read-write.")
    parser.add_argument("--tmpfs", action="append", default=[], help="PATH for an empty tmpfs.")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)

    root = args.root.resolve()
    uid, gid, groups, home = resolve_user(root, args.user)
    environment = dict(item.split("=", 1) for item in args.env)
    environment.setdefault("HOME", home)  # as docker run sets it

    enter_private_mount_namespace()
    mount(root / "proc", "-t", "proc", "proc")
    mount(root / "dev", "--rbind", "/dev")
    mount(root / "sys", "--rbind", "-o", "ro", "/sys")
    for path in args.tmpfs:
        mount(inside(root, path), "-t", "tmpfs", "-o", "mode=1777", "tmpfs")
    for volume in args.volume:
        source, path = volume.rsplit(":", 1)
        mount(inside(root, path), "--bind", source)

    os.chroot(root)
    os.chdir(args.workdir)
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    os.execvpe(args.command[0], args.command, environment)  # searches the image's PATH


def enter_private_mount_namespace() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed (this needs root)")
    # the copied mounts stop propagating to the host's namespace, ours stop coming back to it
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)


def mount(target: Path, *options: str) -> None:
    if not target.is_dir():
        raise SystemExit(f"chroot_run: the image has no directory {target}: cannot mount it")
    subprocess.run(["mount", *options, str(target)], check=True)


def inside(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def resolve_user(root: Path, user: str) -> tuple[int, int, list[int], str]:
    """(uid, gid, supplementary gids, home) of an image's ``User`` value, from the image's own files."""
    name, _, group = user.partition(":")
    passwd = [line.split(":") for line in (root / "etc/passwd").read_text().splitlines() if line]
    entry = next((fields for fields in passwd if name in (fields[0], fields[2])), None)
    if entry is None and not name.isdigit():
        raise SystemExit(f"chroot_run: the image's /etc/passwd has no user {name!r}")
    uid = int(entry[2]) if entry else int(name)
    group_file = [line.split(":") for line in (root / "etc/group").read_text().splitlines() if line]
    if group:
        named = next((fields for fields in group_file if group in (fields[0], fields[2])), None)
        if named is None and not group.isdigit():
            raise SystemExit(f"chroot_run: the image's /etc/group has no group {group!r}")
        gid = int(named[2]) if named else int(group)
    else:
        gid = int(entry[3]) if entry else 0
    groups = [gid]
    if entry:  # the user's other groups, as the image lists them
        groups += [int(fields[2]) for fields in group_file if entry[0] in fields[3].split(",")]
    return uid, gid, sorted(set(groups)), entry[5] if entry else "/"


if __name__ == "__main__":
    main()
