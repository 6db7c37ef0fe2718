"""Issue 15: a deduplicated save does not read a file that is unchanged since the last save of the same manager
read it (lstat identity, git's racily-clean rule); it takes that save's chunk list once every chunk is known
stored. Every case below checks what the step restores, not only what was read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers import snapshot
from taskpoint import CheckpointManager
from taskpoint.manager import snapshots

OLD = time.time() - 3600
SIZE = 300_000


def _tree(root: Path, files: int = 4) -> Path:
    root.mkdir(parents=True)
    (root / "sub").mkdir()
    for i in range(files):
        where = root / ("sub" if i % 2 else "") / f"w{i}.bin"
        where.write_bytes(os.urandom(SIZE))
        os.utime(where, (OLD, OLD))  # written long ago, like a frozen base model
    return root


def _manager(store, **kwargs) -> CheckpointManager:
    return CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True, **kwargs)


def _last(mgr: CheckpointManager):
    assert mgr._dedup.last is not None
    return mgr._dedup.last


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_an_unchanged_tree_is_not_read_again_and_restores_as_saved(store, tmp_path):
    tree = _tree(tmp_path / "tree")
    with _manager(store) as mgr:
        mgr.save(tree, 1)
        assert _last(mgr).unread_bytes == 0 and _last(mgr).uploaded_chunks == 4
        mgr.save(tree, 2)
        assert _last(mgr).unread_bytes == 4 * SIZE
        assert _last(mgr).uploaded_bytes == 0 and _last(mgr).chunks == 4
        (tree / "w0.bin").write_bytes(os.urandom(SIZE))  # rewritten now: read, and its chunk uploaded
        mgr.save(tree, 3)
        assert _last(mgr).unread_bytes == 3 * SIZE and _last(mgr).uploaded_chunks == 1
        expected = snapshot(tree)
    with _manager(store) as other:  # a fresh process's view: the manifests name the right chunks
        assert snapshot(other.restore(3, into=tmp_path / "out")) == expected
        assert snapshot(other.restore(2, into=tmp_path / "out2"))["sub/w1.bin"] == expected["sub/w1.bin"]


def test_a_rewrite_that_puts_size_and_mtime_back_is_read(tmp_path):
    """Same size, the old modification time restored: only the change time tells; the step holds the new
    bytes."""
    tree = _tree(tmp_path / "tree")
    with CheckpointManager(tmp_path / "ckpts", dedup=True) as mgr:
        mgr.save(tree, 1)
        target = tree / "sub" / "w1.bin"
        with open(target, "r+b") as f:
            f.write(b"\xff" * 100)
        os.utime(target, (OLD, OLD))
        mgr.save(tree, 2)
        assert _last(mgr).unread_bytes == 3 * SIZE
        assert (mgr.restore(2, into=tmp_path / "out") / "sub" / "w1.bin").read_bytes() == target.read_bytes()


def test_a_file_replaced_by_another_of_the_same_size_and_mtime_is_read(tmp_path):
    tree = _tree(tmp_path / "tree")
    with CheckpointManager(tmp_path / "ckpts", dedup=True) as mgr:
        mgr.save(tree, 1)
        fresh = tmp_path / "fresh.bin"
        fresh.write_bytes(os.urandom(SIZE))
        os.utime(fresh, (OLD, OLD))
        os.replace(fresh, tree / "w0.bin")
        mgr.save(tree, 2)
        assert _last(mgr).unread_bytes == 3 * SIZE
        assert snapshot(mgr.restore(2, into=tmp_path / "out")) == snapshot(tree)


def test_a_file_modified_just_before_a_save_is_read_again_at_the_next(tmp_path):
    """Git's racily-clean rule: a write in the same clock tick as the read would leave the identity
    unchanged, so a file modified less than RACY_SECONDS before a save is never trusted by the next one."""
    tree = _tree(tmp_path / "tree")
    recent = tree / "w0.bin"
    recent.write_bytes(os.urandom(SIZE))  # modified now
    with CheckpointManager(tmp_path / "ckpts", dedup=True) as mgr:
        mgr.save(tree, 1)
        with open(recent, "r+b") as f:  # rewritten in place: size kept, mtime may fall in the same tick
            f.write(b"\x00" * SIZE)
        mgr.save(tree, 2)
        assert _last(mgr).unread_bytes == 3 * SIZE
        assert (mgr.restore(2, into=tmp_path / "out") / "w0.bin").read_bytes() == b"\x00" * SIZE


def test_chunks_removed_by_another_managers_gc_are_read_and_stored_again(tmp_path):
    tree = _tree(tmp_path / "tree", files=2)
    with CheckpointManager(tmp_path / "ckpts", dedup=True) as mgr:
        mgr.save(tree, 1)
        with CheckpointManager(tmp_path / "ckpts", dedup=True, grace_seconds=0) as other:
            other.delete(1, force=True)
            assert len(other.gc()) == 2  # the two chunks: no step names them
        mgr.save(tree, 2)  # the epoch moved: the store is listed again and lacks them
        assert _last(mgr).unread_bytes == 0 and _last(mgr).uploaded_chunks == 2
        assert snapshot(mgr.restore(2, into=tmp_path / "out")) == snapshot(tree)


def test_snapshot_all_reads_every_file(tmp_path, monkeypatch):
    tree = _tree(tmp_path / "tree")
    with CheckpointManager(tmp_path / "ckpts", dedup=True) as mgr:
        mgr.save(tree, 1)
        monkeypatch.setenv(snapshots.ENV_SNAPSHOT_ALL, "1")
        mgr.save(tree, 2)
        assert _last(mgr).unread_bytes == 0 and _last(mgr).chunks == 4


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
@pytest.mark.e2e("starts a save process")
def test_background_saves_do_not_read_the_files_their_snapshot_linked(store, tmp_path):
    """A snapshot's unchanged files are hard links into the snapshot before (a new change time, the same
    inode): the save takes their chunk lists; the file the caller rewrote is read."""
    tree = _tree(tmp_path / "tree")
    (tmp_path / "snaps").mkdir()
    with _manager(store, async_save=True, snapshot_dir=tmp_path / "snaps") as mgr:
        mgr.save(tree, 1)
        mgr.wait_until_finished()
        (tree / "w0.bin").write_bytes(os.urandom(SIZE))
        mgr.save(tree, 2)
        expected = snapshot(tree)
        for f in tree.rglob("*.bin"):  # the caller goes on at once: the step keeps what was snapshotted
            f.write_bytes(b"later")
        mgr.wait_until_finished()
        assert mgr._background._snapshots.linked == 3
        assert _last(mgr).unread_bytes == 3 * SIZE and _last(mgr).uploaded_chunks == 1
        assert snapshot(mgr.restore(2, into=tmp_path / "out")) == expected


def test_a_file_that_changes_while_it_is_read_is_not_trusted_next_time(tmp_path):
    """ReadIndex records a file only when its status after the read is the one before it."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 10)
    os.utime(path, (OLD, OLD))
    index = snapshots.ReadIndex()
    index.begin()
    before = os.stat(path)
    path.write_bytes(b"b" * 10)
    index.record(before, os.stat(path), ("k",))
    index.commit()
    index.begin()
    assert index.reuse(os.stat(path), linked=False) is None
    index.record(os.stat(path), os.stat(path), ("k2",))  # an unchanged read is recorded
    index.commit()
    index.begin()
    assert index.reuse(os.stat(path), linked=False) is None  # ...but modified just now: not trusted
    os.utime(path, (OLD, OLD))
    index.begin()
    index.record(os.stat(path), os.stat(path), ("k3",))
    index.commit()
    index.begin()
    assert index.reuse(os.stat(path), linked=False) == ("k3",)
