"""A directory step restored from local disk: the archive is read from the stored file by offset, the data of its
stored gzip members copied by the kernel (``os.sendfile``) into the extracted files while a thread hashes the file;
nothing is published before the digest matches. Damage, a file shorter than its manifest says or truncated during
the restore, and a destination on another file system each give what a streamed restore gives."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import make_tree, snapshot
from taskpoint import CheckpointCorruptError, CheckpointManager
from taskpoint.storage.streams import OrderedFutureReader
from test_stored_member_reads import save_tree, weights


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts of every ``os.sendfile`` call (the real one)."""
    counts: list[int] = []
    real = os.sendfile

    def counting(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        n = real(out_fd, in_fd, offset, count)
        counts.append(n)
        return n

    monkeypatch.setattr(os, "sendfile", counting)
    return counts


def weights_folder(tmp_path: Path, size: int) -> Path:
    """A folder ``run`` holding one file of ``size`` bytes of weights (stored, not compressed)."""
    source = tmp_path / "run"
    source.mkdir()
    (source / "model.bin").write_bytes(weights(size))
    return source


def payload_of(steps: Path, step: int) -> Path:
    (payload,) = (steps / f"ckpt-{step}").glob("payload-*")
    return payload


def test_a_step_on_local_disk_is_restored_with_its_stored_data_copied_by_the_kernel(
        tmp_path: Path, sent: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    source = save_tree(tmp_path / "run")  # stored weights (one not a multiple of 512), a compressed log, an empty file
    views: list[int] = []
    read_view = OrderedFutureReader.read_view
    monkeypatch.setattr(OrderedFutureReader, "read_view", lambda self, n: views.append(n) or read_view(self, n))
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(source, 1)
        restored = m.restore(1, into=tmp_path / "out")
    assert snapshot(restored) == snapshot(source)
    assert sum(sent) >= 11 << 20  # the weights, all but what shares a compressed member with the log or headers
    assert views == []  # nothing streamed through a parallel gzip reader's views


def test_damage_in_the_middle_of_a_stored_member_is_refused_naming_its_piece_and_nothing_is_published(
        tmp_path: Path, sent: list[int]) -> None:
    source = weights_folder(tmp_path, 40 << 20)
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(source, 1)
        payload = payload_of(tmp_path / "steps", 1)
        with open(payload, "r+b") as f:  # in piece 1 (16-32 MiB): data of a stored block, no header
            f.seek(20 << 20)
            byte = f.read(1)
            f.seek(20 << 20)
            f.write(bytes([byte[0] ^ 0x40]))
        target = tmp_path / "out"
        target.mkdir()
        (target / "kept.txt").write_text("as it was")
        with pytest.raises(CheckpointCorruptError) as refused:
            m.restore(1, into=target)
    assert type(refused.value) is CheckpointCorruptError
    assert f"piece 1 of {payload.name}" in str(refused.value)
    assert sum(sent) > 16 << 20  # the damaged bytes were copied to staging, and never published
    assert os.listdir(target) == ["kept.txt"] and (target / "kept.txt").read_text() == "as it was"


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_stored_object_shorter_than_its_manifest_says_is_refused_as_damage(tmp_path: Path, keep: float) -> None:
    """Cut in the middle, or in its last member: a clear CheckpointCorruptError, nothing in the target."""
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(save_tree(tmp_path / "run"), 1)
        payload = payload_of(tmp_path / "steps", 1)
        os.truncate(payload, int(payload.stat().st_size * keep))
        target = tmp_path / "out"
        with pytest.raises(CheckpointCorruptError, match="damaged"):
            m.restore(1, into=target)
    assert not target.exists() or os.listdir(target) == []


def test_a_stored_object_truncated_during_the_restore_is_refused_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated by someone else after the restore opened it, between two of the kernel's copies: the next copy
    and the hash come up short (no memory map, so no SIGBUS), and the restore says the step is damaged."""
    source = weights_folder(tmp_path, 24 << 20)
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(source, 1)
        payload = payload_of(tmp_path / "steps", 1)
        real = os.sendfile
        calls: list[int] = []

        def truncating(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
            calls.append(count)
            if len(calls) == 3:
                os.truncate(payload, 8 << 20)
            return real(out_fd, in_fd, offset, count)

        monkeypatch.setattr(os, "sendfile", truncating)
        target = tmp_path / "out"
        with pytest.raises(CheckpointCorruptError, match=r"damaged|changed|shorter"):
            m.restore(1, into=target)
    assert len(calls) >= 3
    assert not target.exists() or os.listdir(target) == []


@pytest.fixture
def other_file_system(tmp_path: Path) -> Iterator[Path]:
    """A folder of its own on /dev/shm (tmpfs), where tmp_path is on another file system."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    folder = Path(tempfile.mkdtemp(prefix="taskpoint-test-restore-", dir="/dev/shm"))
    try:
        if os.stat(folder).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm and the test's folder are one file system here")
        yield folder
    finally:
        for below, folders, files in os.walk(folder, topdown=False):
            for name in files:
                os.unlink(os.path.join(below, name))
            for name in folders:
                path = os.path.join(below, name)
                os.rmdir(path) if not os.path.islink(path) else os.unlink(path)
        os.rmdir(folder)


def test_a_step_restores_onto_another_file_system(tmp_path: Path, other_file_system: Path, sent: list[int]) -> None:
    source = save_tree(tmp_path / "run")
    make_tree(source / "more")
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(source, 1)
        restored = m.restore(1, into=other_file_system / "out")
    assert snapshot(restored) == snapshot(source)
    assert sum(sent) > 8 << 20


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EXDEV, errno.ENOSYS])
def test_where_the_kernel_cannot_copy_between_the_files_the_data_is_read_and_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """``os.sendfile`` refused (an older kernel, or a file system without it): the rest goes by reads and writes,
    and the files are the same."""
    refused: list[Any] = []

    def refusing(*args: Any) -> int:
        refused.append(args)
        raise OSError(code, os.strerror(code))

    source = save_tree(tmp_path / "run")
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(source, 1)
        monkeypatch.setattr(os, "sendfile", refusing)
        restored = m.restore(1, into=tmp_path / "out")
    assert snapshot(restored) == snapshot(source)
    assert len(refused) == 1  # tried once, then reads and writes for the rest
