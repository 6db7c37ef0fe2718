"""Damaged and hostile checkpoints: load detects them, refuses them, and writes nothing outside the workspace."""

from __future__ import annotations

import os
import re
import tarfile

import pytest

from helpers import make_tree, member, read_object, tar_gz, write_object
from taskpoint import Checkpoint, CheckpointCorruptError, UnsafeArchiveError


def _saved(store, tmp_path, kind):
    dest = store.url("ckpt")
    if kind == "directory":
        data = make_tree(tmp_path / "src", big=300_000)
    elif kind == "file":
        data = tmp_path / "model.bin"
        data.write_bytes(os.urandom(400_000))
    else:
        data = os.urandom(400_000)
    Checkpoint(dest, storage_options=store.storage_options).save_sync(data)
    return dest


def _load(store, src):
    with Checkpoint(store.url("next"), src, storage_options=store.storage_options) as cp:
        return cp.load_sync()


@pytest.mark.parametrize("kind", ["directory", "file", "bytes"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_anywhere_is_detected(store, tmp_path, kind, where):
    dest = _saved(store, tmp_path, kind)
    blob = bytearray(read_object(dest, store.storage_options))
    index = {"first": 0, "middle": len(blob) // 2, "last": len(blob) - 1}[where]
    blob[index] ^= 0x01
    write_object(dest, store.storage_options, bytes(blob))
    with pytest.raises(CheckpointCorruptError, match="ckpt"):
        _load(store, dest)


@pytest.mark.parametrize("kind", ["directory", "file", "bytes"])
@pytest.mark.parametrize("keep", [0, 10, 0.5, -8])
def test_truncated_object_is_detected(store, tmp_path, kind, keep):
    dest = _saved(store, tmp_path, kind)
    blob = read_object(dest, store.storage_options)
    cut = blob[: int(len(blob) * keep)] if isinstance(keep, float) else blob[:keep]
    write_object(dest, store.storage_options, cut)
    with pytest.raises(CheckpointCorruptError):
        _load(store, dest)


def test_random_blob_in_place_of_directory_checkpoint_is_corrupt(store, tmp_path):
    dest = _saved(store, tmp_path, "directory")
    write_object(dest, store.storage_options, os.urandom(5000))
    with pytest.raises(CheckpointCorruptError):
        _load(store, dest)


def test_failed_load_leaves_workspace_untouched_and_is_not_cached(store, tmp_path):
    dest = _saved(store, tmp_path, "directory")
    good = read_object(dest, store.storage_options)
    blob = bytearray(good)
    blob[len(blob) // 2] ^= 0xFF
    write_object(dest, store.storage_options, bytes(blob))
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as cp:
        (cp.path / "mine.txt").write_text("user file")
        with pytest.raises(CheckpointCorruptError):
            cp.load_sync()
        assert sorted(os.listdir(cp.path)) == ["mine.txt"]
        write_object(dest, store.storage_options, good)  # repaired: the next load must try again
        assert (cp.load_sync() / "state.json").exists()


def test_gzip_that_is_not_a_tar_without_record_loads_as_payload(tmp_path):
    import gzip

    data = gzip.compress(b"just a gzip file")
    (tmp_path / "obj").write_bytes(data)
    with Checkpoint(tmp_path / "x", tmp_path / "obj") as cp:
        assert cp.load_sync().read_bytes() == data


def test_random_blob_without_record_loads_as_payload(tmp_path):
    blob = os.urandom(3000)
    (tmp_path / "obj").write_bytes(blob)
    with Checkpoint(tmp_path / "x", tmp_path / "obj") as cp:
        assert cp.load_sync().read_bytes() == blob


def test_unreadable_record_is_reported_as_corrupt(tmp_path):
    Checkpoint(tmp_path / "ckpt").save_sync(b"x")
    (tmp_path / "ckpt.taskpoint.json").write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="record"):
        _load_local(tmp_path)


def test_record_from_newer_taskpoint_asks_for_upgrade(tmp_path):
    Checkpoint(tmp_path / "ckpt").save_sync(b"x")
    record = tmp_path / "ckpt.taskpoint.json"
    record.write_text(re.sub(r'"version": \d+', '"version": 99', record.read_text()))
    with pytest.raises(CheckpointCorruptError, match="upgrade"):
        _load_local(tmp_path)


def test_recorded_checkpoint_whose_object_vanished_is_an_error_not_none(store, tmp_path):
    dest = _saved(store, tmp_path, "bytes")
    fs = store.fs()
    fs.rm(fs._strip_protocol(dest))
    with pytest.raises(CheckpointCorruptError, match="missing"):
        _load(store, dest)


def test_a_format_1_record_left_by_an_interrupted_save_still_loads_with_a_warning(tmp_path):
    """An older taskpoint, killed between its object and its final record, left the new save as pending without a
    digest: that checkpoint must stay loadable (with the archive's own checks, and a warning)."""
    import json

    dest = tmp_path / "ckpt"
    Checkpoint(dest).save_sync(b"old state")
    old = json.loads((tmp_path / "ckpt.taskpoint.json").read_bytes())["objects"][0]
    Checkpoint(dest).save_sync(make_tree(tmp_path / "t"))
    new = json.loads((tmp_path / "ckpt.taskpoint.json").read_bytes())["objects"][0]
    legacy = {"format": "taskpoint.checkpoint", "version": 1, "committed": old,
              "pending": {**new, "size": None, "crc32": None}}
    (tmp_path / "ckpt.taskpoint.json").write_text(json.dumps(legacy))
    with pytest.warns(UserWarning, match="stopped before recording its checksum"):
        loaded = _load_local(tmp_path)
    assert (loaded / "state.json").exists()


def _load_local(tmp_path):
    # Not closed: the returned path stays valid until interpreter exit, as for a user.
    return Checkpoint(tmp_path / "next", tmp_path / "ckpt").load_sync()


# -- hostile archives ----------------------------------------------------------------------------------

HOSTILE = {
    "absolute-path": [(member("/tmp/taskpoint-escape-abs.txt"), b"pwned")],
    "dot-dot": [(member("../escape.txt"), b"pwned")],
    "dot-dot-nested": [(member("a/../../escape.txt"), b"pwned")],
    "symlink-absolute": [(member("link", tarfile.SYMTYPE, linkname="/etc"), None)],
    "symlink-escape": [(member("link", tarfile.SYMTYPE, linkname="../.."), None)],
    "symlink-then-write-through": [
        (member("d", tarfile.DIRTYPE, mode=0o755), None),
        (member("d/up", tarfile.SYMTYPE, linkname=".."), None),
        (member("d/up/up2", tarfile.SYMTYPE, linkname=".."), None),
        (member("d/up/up2/escape.txt"), b"pwned"),
    ],
    "symlink-chain-late": [
        (member("x", tarfile.SYMTYPE, linkname="d/l/.."), None),
        (member("d", tarfile.DIRTYPE, mode=0o755), None),
        (member("d/l", tarfile.SYMTYPE, linkname=".."), None),
    ],
    "hardlink-escape": [(member("h", tarfile.LNKTYPE, linkname="../../etc/passwd"), None)],
    "hardlink-absolute": [(member("h", tarfile.LNKTYPE, linkname="/etc/passwd"), None)],
    "char-device": [(member("dev", tarfile.CHRTYPE), None)],
    "block-device": [(member("blk", tarfile.BLKTYPE), None)],
    "fifo": [(member("fifo", tarfile.FIFOTYPE), None)],
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_archive_is_refused_and_writes_nothing_outside(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    src = outside / "store" / "hostile"
    src.parent.mkdir()
    members = [(member("ok.txt"), b"fine"), *HOSTILE[name]]
    src.write_bytes(tar_gz(members))
    with Checkpoint(outside / "dest", src, workspace=outside / "ws") as cp:
        before = sorted(p for p in tmp_path.rglob("*"))
        with pytest.raises(UnsafeArchiveError):
            cp.load_sync()
        assert os.listdir(cp.path) == []
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert not os.path.exists("/tmp/taskpoint-escape-abs.txt")


def test_hostile_archive_with_forged_record_is_still_refused(tmp_path):
    """A record matching the bytes does not make a hostile archive safe."""
    import hashlib
    import json
    import time

    blob = tar_gz([(member("../escape.txt"), b"pwned")])
    (tmp_path / "ckpt").write_bytes(blob)
    record = {"format": "taskpoint.checkpoint", "version": 1, "pending": None,
              "committed": {"kind": "directory", "codec": "gzip", "save_id": "x", "created": time.time(),
                            "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
    (tmp_path / "ckpt.taskpoint.json").write_text(json.dumps(record))
    with pytest.raises(UnsafeArchiveError):
        _load_local(tmp_path)
    assert not (tmp_path / "escape.txt").exists()


def test_archive_with_safe_links_inside_is_accepted(tmp_path):
    members = [
        (member("d", tarfile.DIRTYPE, mode=0o755), None),
        (member("d/f.txt"), b"data"),
        (member("d/self", tarfile.SYMTYPE, linkname="."), None),
        (member("top", tarfile.SYMTYPE, linkname="d/f.txt"), None),
        (member("hard", tarfile.LNKTYPE, linkname="d/f.txt"), None),
    ]
    (tmp_path / "ckpt").write_bytes(tar_gz(members))
    loaded = _load_local(tmp_path)
    assert (loaded / "top").read_text() == "data"
    assert (loaded / "hard").read_text() == "data"
    assert os.stat(loaded / "hard").st_ino == os.stat(loaded / "d" / "f.txt").st_ino


def test_truncation_at_a_gzip_member_boundary_is_detected_even_without_a_record(tmp_path):
    """Concatenated gzip members end cleanly between members; the missing tar end marker still gives it away."""
    from taskpoint.format.pgzip import labelled_length

    Checkpoint(tmp_path / "ckpt").save_sync(make_tree(tmp_path / "src", big=9 << 20))
    blob = (tmp_path / "ckpt").read_bytes()
    first = labelled_length(blob[:64])
    assert first is not None and first < len(blob)  # several members
    (tmp_path / "ckpt").write_bytes(blob[:first])
    (tmp_path / "ckpt.taskpoint.json").unlink()  # no record: only the archive itself can tell
    with pytest.raises(CheckpointCorruptError, match="damaged"):
        _load_local(tmp_path)
