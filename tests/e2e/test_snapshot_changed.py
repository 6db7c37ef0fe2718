"""Issue 15 item 4: a background save copies only the files that changed since the last snapshot; the others
are hard links into the snapshot kept from the last save. Unchanged is judged by lstat (device, inode, size,
mtime, ctime), and a file modified less than RACY_SECONDS before a snapshot is never trusted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import taskpoint
from helpers import snapshot
from taskpoint.manager import snapshots

OLD = time.time() - 3600


def _tree(root: Path, files: int = 6, size: int = 200_000) -> Path:
    (root.parent / "snaps").mkdir(exist_ok=True)
    root.mkdir(parents=True)
    (root / "sub").mkdir()
    for i in range(files):
        where = root / ("sub" if i % 2 else "") / f"w{i}.bin"
        where.write_bytes(os.urandom(size))
        os.utime(where, (OLD, OLD))  # written long ago: trusted when unchanged
    return root


def _cache(mgr: taskpoint.CheckpointManager) -> snapshots.SnapshotCache:
    return mgr._background._snapshots


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
@pytest.mark.parametrize("dedup", [False, True])
def test_unchanged_files_are_linked_not_copied_and_every_step_restores_as_saved(store, tmp_path, dedup):
    tree = _tree(tmp_path / "tree")
    with taskpoint.CheckpointManager(store.url("m"), storage_options=store.storage_options, async_save=True,
                                     snapshot_dir=tmp_path / "snaps", dedup=dedup) as mgr:
        mgr.save(tree, 1)
        first = snapshot(tree)
        assert _cache(mgr).copied == 6 and _cache(mgr).linked == 0
        mgr.wait_until_finished()
        (tree / "w0.bin").write_bytes(os.urandom(200_000))  # one file rewritten
        mgr.save(tree, 2)
        second = snapshot(tree)
        assert (_cache(mgr).copied, _cache(mgr).linked) == (1, 5)
        # The caller changes its files as soon as save returns: the step keeps what they were.
        for f in tree.rglob("*.bin"):
            with open(f, "r+b") as out:
                out.write(b"changed after the save returned")
        mgr.wait_until_finished()
        assert snapshot(mgr.restore(1)) == first
        assert snapshot(mgr.restore(2)) == second


def test_a_file_rewritten_with_its_old_size_and_mtime_is_still_copied(tmp_path):
    """A writer that keeps the size and puts the old modification time back: the change time gives it away."""
    tree = _tree(tmp_path / "tree")
    with taskpoint.CheckpointManager(tmp_path / "m", async_save=True, snapshot_dir=tmp_path / "snaps") as mgr:
        mgr.save(tree, 1)
        mgr.wait_until_finished()
        target = tree / "sub" / "w1.bin"
        target.write_bytes(os.urandom(200_000))
        os.utime(target, (OLD, OLD))
        mgr.save(tree, 2)
        assert (_cache(mgr).copied, _cache(mgr).linked) == (1, 5)
        mgr.wait_until_finished()
        assert (mgr.restore(2) / "sub" / "w1.bin").read_bytes() == target.read_bytes()


def test_a_file_modified_just_before_a_snapshot_is_copied_again_next_time(tmp_path):
    tree = _tree(tmp_path / "tree")
    fresh = tree / "w0.bin"
    now = time.time()
    os.utime(fresh, (now, now))  # within RACY_SECONDS of the snapshot: its times cannot be trusted yet
    with taskpoint.CheckpointManager(tmp_path / "m", async_save=True, snapshot_dir=tmp_path / "snaps") as mgr:
        mgr.save(tree, 1)
        mgr.wait_until_finished()
        mgr.save(tree, 2)
        assert (_cache(mgr).copied, _cache(mgr).linked) == (1, 5)


def test_copying_every_file_can_be_asked_for_and_close_removes_the_kept_snapshot(tmp_path, monkeypatch):
    tree = _tree(tmp_path / "tree")
    snaps = tmp_path / "snaps"
    with taskpoint.CheckpointManager(tmp_path / "m", async_save=True, snapshot_dir=snaps) as mgr:
        mgr.save(tree, 1)
        mgr.wait_until_finished()
        assert len(list(snaps.iterdir())) == 1  # kept for the next save
        monkeypatch.setenv(snapshots.ENV_SNAPSHOT_ALL, "1")
        mgr.save(tree, 2)
        mgr.wait_until_finished()
    assert list(snaps.iterdir()) == []
    monkeypatch.delenv(snapshots.ENV_SNAPSHOT_ALL)
    with taskpoint.CheckpointManager(tmp_path / "m", async_save=True, snapshot_dir=snaps) as mgr:
        assert snapshot(mgr.restore(2)) == snapshot(tree)
