"""``--max_disk_space``: keep the Hugging Face cache within a bound by evicting what was used least recently.

Before a server downloads a checkpoint file of ``size`` bytes, ``make_room`` checks that it fits
both on the disk (keeping 1 GiB free for the system) and under the bound (the cache's files plus
the new one). If not, it deletes whole cached files of *other* models, least recently used first
(a file's access time, which ``mark_used`` refreshes whenever a checkpoint file is opened), until
the new file fits. If even evicting every other model would not be enough, nothing is deleted
and ``DiskSpaceError`` says how much is missing. Servers sharing a cache serialize this under a
file lock, as Petals does.

The layout is the hub cache's: ``models--ORG--NAME/blobs/<hash>`` holds the bytes,
``snapshots/<revision>/<file>`` are symlinks to the blobs.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OS_RESERVE = 2**30  # bytes left free on the disk for everything else
LOCK_FILE = ".petals-disk-space.lock"


class DiskSpaceError(OSError):
    """A download does not fit, even after evicting every other model's cached files."""


@dataclass(frozen=True)
class CachedFile:
    repo_folder: str  # e.g. models--org--name
    blob: Path
    size: int
    last_used: float
    links: tuple[Path, ...]  # the snapshot symlinks pointing at the blob


def repo_folder(repo_id: str) -> str:
    """The cache folder of a model repo (``org/name`` → ``models--org--name``)."""
    return "models--" + repo_id.replace("/", "--")


def cached_files(cache_dir: Path) -> list[CachedFile]:
    """Every blob of every model in the cache, with the snapshot links that point at it."""
    files = []
    for repo in sorted(cache_dir.glob("models--*")):
        links: dict[Path, list[Path]] = {}
        for link in (repo / "snapshots").rglob("*"):
            if link.is_symlink():
                links.setdefault(link.resolve(), []).append(link)
        blobs = repo / "blobs"
        for blob in sorted(blobs.iterdir()) if blobs.is_dir() else ():
            if blob.is_file():
                stat = blob.stat()
                files.append(
                    CachedFile(
                        repo.name, blob, stat.st_size, stat.st_atime, tuple(links.get(blob.resolve(), ()))
                    )
                )
    return files


def make_room(size: int, cache_dir: Path, max_disk_space: int | None, keep_repo: str) -> None:
    """Evict least recently used files of models other than ``keep_repo`` until ``size`` more bytes fit."""
    files = cached_files(cache_dir)
    available = shutil.disk_usage(cache_dir).free - OS_RESERVE
    if max_disk_space is not None:
        available = min(available, max_disk_space - sum(file.size for file in files))
    if size <= available:
        return
    evictable = sorted(
        (file for file in files if file.repo_folder != repo_folder(keep_repo)),
        key=lambda file: file.last_used,
    )
    chosen, freed = [], 0
    for file in evictable:
        if available + freed >= size:
            break
        chosen.append(file)
        freed += file.size
    if available + freed < size:
        raise DiskSpaceError(
            f"{keep_repo}: a {size / 2**20:.1f} MiB download does not fit in {cache_dir} even after evicting "
            f"every other model ({(size - available - freed) / 2**20:.1f} MiB short): raise --max_disk_space "
            "or free disk space"
        )
    for file in chosen:
        for link in file.links:
            link.unlink(missing_ok=True)
        file.blob.unlink(missing_ok=True)
    logger.info(
        "Evicted %d cached files (%.1f MiB) of other models to fit %.1f MiB under --max_disk_space",
        len(chosen),
        freed / 2**20,
        size / 2**20,
    )


def mark_used(path: Path) -> None:
    """Record that a cached file was just used (its atime; mtime kept), whatever the mount's atime policy."""
    with contextlib.suppress(OSError):
        os.utime(path, (time.time(), path.stat().st_mtime))


@contextlib.contextmanager
def cache_lock(cache_dir: Path) -> Iterator[None]:
    """One process at a time frees space and downloads into ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
