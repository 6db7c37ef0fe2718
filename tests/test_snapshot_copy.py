"""The copier behind background-save snapshots: parallel, complete, with metadata, and loud on any failure."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from taskpoint import CheckpointManager
from taskpoint.storage.localio import ParallelCopy


def _tree(root, files=40):
    (root / "a" / "b").mkdir(parents=True)
    for i in range(files):
        folder = root / ("a" if i % 3 == 0 else "a/b" if i % 3 == 1 else ".")
        (folder / f"f{i}.bin").write_bytes(os.urandom(i * 997))
    (root / "big.bin").write_bytes(os.urandom(3 << 20))
    os.chmod(root / "a" / "f0.bin", 0o640)
    os.utime(root / "big.bin", (1_000_000, 1_000_000))
    return root


def _listing(root):
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[path.relative_to(root).as_posix()] = (
            stat.S_IMODE(st.st_mode), path.is_dir(), None if path.is_dir() else path.read_bytes(),
            None if path.is_dir() else int(st.st_mtime))
    return out


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copies_a_tree_with_contents_modes_and_times(tmp_path, threads):
    source = _tree(tmp_path / "src")
    copier = ParallelCopy(threads)
    shutil.copytree(source, tmp_path / "dst", symlinks=True, copy_function=copier)
    copier.finish()
    assert _listing(tmp_path / "dst") == _listing(source)


def test_a_missing_source_raises_from_finish(tmp_path):
    copier = ParallelCopy()
    copier(tmp_path / "nope.bin", tmp_path / "out.bin")
    with pytest.raises(FileNotFoundError):
        copier.finish()


def test_a_file_whose_size_changes_during_the_copy_is_an_error_not_a_short_copy(tmp_path):
    # /proc files report size 0 and then read as text: a real file whose bytes differ from its stat size.
    copier = ParallelCopy()
    copier("/proc/self/status", tmp_path / "status")
    with pytest.raises(RuntimeError, match="changed size"):
        copier.finish()


@pytest.mark.e2e("starts a save process")
def test_a_failed_snapshot_saves_nothing_and_leaves_no_scratch(tmp_path, monkeypatch):
    source = _tree(tmp_path / "src")
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def failing_copy(src, dst):
        raise OSError(28, "No space left on device", dst)

    with CheckpointManager(tmp_path / "steps", snapshot_dir=scratch) as manager:
        # A mock: a disk that fills up exactly during the snapshot.
        monkeypatch.setattr("taskpoint.storage.localio.copy_with_metadata", failing_copy)
        with pytest.raises(OSError, match="No space left"):
            manager.save(source, 1, blocking=False)
        monkeypatch.undo()
        assert manager.steps() == []
        assert list(scratch.iterdir()) == []
        manager.save(source, 2, blocking=False)
        manager.wait_until_finished()
        assert _listing(manager.restore(2)) == _listing(source)


@pytest.mark.parametrize("platform_has_preadv", [True, False])
def test_hashing_by_reading_stops_at_the_real_end_of_a_file_that_got_shorter(tmp_path, monkeypatch,
                                                                             platform_has_preadv):
    import hashlib

    from taskpoint.storage import digest_by_reading

    if not platform_has_preadv:
        monkeypatch.delattr(os, "preadv")  # as on platforms without it
    data = os.urandom(3 * (1 << 20) + 123)
    path = tmp_path / "object"
    path.write_bytes(data)
    with open(path, "rb") as f:
        whole = hashlib.sha256()
        assert digest_by_reading(f.fileno(), len(data), whole) == len(data)
        assert whole.hexdigest() == hashlib.sha256(data).hexdigest()
        os.truncate(path, 1 << 20)  # someone else shortens the stored object while it is open
        short = hashlib.sha256()
        assert digest_by_reading(f.fileno(), len(data), short) == 1 << 20
        assert short.hexdigest() == hashlib.sha256(data[:1 << 20]).hexdigest()
