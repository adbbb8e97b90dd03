"""``--max_disk_space``: least recently used files of other models leave the hub cache first.

The hub cannot be reached here, so the eviction is tested on a real hub-cache layout on disk
(blobs and snapshot symlinks, as ``huggingface_hub`` writes them).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from petals.disk_cache import DiskSpaceError, cached_files, make_room, mark_used

MiB = 2**20


def cache_model(cache_dir: Path, repo_id: str, files: dict[str, int], last_used: float) -> list[Path]:
    """A model in the hub cache layout with files of the given sizes, last used at ``last_used``."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    blobs = []
    for name, size in files.items():
        blob = repo / "blobs" / f"{repo_id.replace('/', '-')}-{name}"
        blob.write_bytes(b"\0" * size)
        os.utime(blob, (last_used, last_used))
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
        blobs.append(blob)
    return blobs


@pytest.fixture
def hub_cache(tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    old = cache_model(
        cache, "org/old", {"model-1.safetensors": 3 * MiB, "model-2.safetensors": 3 * MiB}, 1000
    )
    recent = cache_model(cache, "org/recent", {"model.safetensors": 4 * MiB}, 3000)
    serving = cache_model(cache, "org/serving", {"model-1.safetensors": 2 * MiB}, 500)
    return cache, old, recent, serving


def test_files_fitting_under_the_bound_evict_nothing(hub_cache):
    cache, *_ = hub_cache
    make_room(2 * MiB, cache, max_disk_space=20 * MiB, keep_repo="org/serving")
    assert sum(file.size for file in cached_files(cache)) == 12 * MiB


def test_least_recently_used_files_of_other_models_are_evicted_first(hub_cache):
    cache, old, recent, serving = hub_cache
    mark_used(old[1])  # the second shard of the old model was just read: it is now the most recent
    make_room(5 * MiB, cache, max_disk_space=14 * MiB, keep_repo="org/serving")
    remaining = {file.blob for file in cached_files(cache)}
    # 12 MiB cached + 5 MiB new > 14 MiB: 3 MiB must go; the oldest other-model file is old[0]
    assert remaining == {old[1], *recent, *serving}
    snapshot_links = list((cache / "models--org--old" / "snapshots").rglob("*.safetensors"))
    assert [link.name for link in snapshot_links] == ["model-2.safetensors"]


def test_the_model_being_served_is_never_evicted(hub_cache):
    cache, old, recent, serving = hub_cache
    make_room(9 * MiB, cache, max_disk_space=12 * MiB, keep_repo="org/serving")
    assert {file.blob for file in cached_files(cache)} == set(serving)


def test_a_download_that_cannot_fit_changes_nothing_and_says_what_to_do(hub_cache):
    cache, *_ = hub_cache
    with pytest.raises(DiskSpaceError, match="raise --max_disk_space or free disk space"):
        make_room(20 * MiB, cache, max_disk_space=15 * MiB, keep_repo="org/serving")
    assert sum(file.size for file in cached_files(cache)) == 12 * MiB


def test_max_disk_space_takes_petals_size_spellings():
    from click.testing import CliRunner

    from petals.cli import main

    result = CliRunner().invoke(main, ["serve", "x/y", "--max_disk_space", "lots"])
    assert result.exit_code == 2 and "expected a size such as 50GB, 100GiB" in result.output
