"""Checkpoint round trips and contracts on every store: local disk, memory://, S3, GCS and Azure servers."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import taskpoint
from helpers import make_tree, object_exists, read_object, snapshot, snapshot_with_times, write_object
from taskpoint import BaseCheckpoint, Checkpoint, CheckpointManager

# -- bytes, files, directories --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"step=42", bytearray(b"\x00\x01binary\xff"), memoryview(b"viewed bytes"), b"", os.urandom(3 << 20)],
    ids=["bytes", "bytearray", "memoryview", "empty", "3MiB"],
)
def test_bytes_round_trip_holds_exactly_those_bytes(store, data):
    dest = store.url("a", "ckpt")
    with Checkpoint(dest, storage_options=store.storage_options) as cp:
        cp.save_sync(data)
    assert read_object(dest, store.storage_options) == bytes(data)
    with Checkpoint(store.url("b", "ckpt"), dest, storage_options=store.storage_options) as nxt:
        assert nxt.prev_exists()
        loaded = nxt.load_sync()
        assert loaded == nxt.path / "payload"
        assert loaded.read_bytes() == bytes(data)


def test_file_round_trip_keeps_its_bytes(store, tmp_path):
    src = tmp_path / "model.pt"
    src.write_bytes(os.urandom(200_000))
    dest = store.url("file-ckpt")
    with Checkpoint(dest, storage_options=store.storage_options) as cp:
        cp.save_sync(src)
        assert read_object(dest, store.storage_options) == src.read_bytes()
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as nxt:
        assert nxt.load_sync().read_bytes() == src.read_bytes()


def test_single_file_that_is_a_tar_comes_back_as_a_file(store, tmp_path):
    archive = tmp_path / "dataset.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("inside.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    dest = store.url("ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(str(archive))
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as nxt:
        loaded = nxt.load_sync()
        assert loaded == nxt.path / "payload"
        assert loaded.read_bytes() == archive.read_bytes()
        assert not (nxt.path / "inside.txt").exists()


def test_directory_round_trip_keeps_tree_links_and_modes(store, tmp_path):
    src = make_tree(tmp_path / "src")
    dest = store.url("dir-ckpt")
    with Checkpoint(dest, storage_options=store.storage_options) as cp:
        cp.save_sync(src)
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as nxt:
        loaded = nxt.load_sync()
        assert loaded == nxt.path
        assert snapshot(loaded) == snapshot(src)
        assert (loaded / "link-to-notes").read_text() == "deep"


def test_directory_archive_holds_top_level_entries_under_their_own_names(store, tmp_path):
    src = make_tree(tmp_path / "src")
    dest = store.url("ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(str(src))
    with tarfile.open(fileobj=io.BytesIO(read_object(dest, store.storage_options)), mode="r:gz") as tar:
        names = tar.getnames()
    assert {n.split("/")[0] for n in names} == set(os.listdir(src))
    assert "src" not in names


def test_empty_directory_round_trip_gives_empty_workspace(store, tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    dest = store.url("ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(src)
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as nxt:
        assert nxt.load_sync() == nxt.path
        assert os.listdir(nxt.path) == []


def test_save_never_modifies_the_source(tmp_path):
    src = make_tree(tmp_path / "src")
    before = snapshot_with_times(src)
    Checkpoint(tmp_path / "out" / "ckpt").save_sync(src)
    assert snapshot_with_times(src) == before


def test_save_overwrites_previous_checkpoint_with_new_kind(store, tmp_path):
    dest = store.url("ckpt")
    cp = Checkpoint(dest, storage_options=store.storage_options)
    cp.save_sync(make_tree(tmp_path / "tree"))
    cp.save_sync(b"now bytes")
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as nxt:
        assert nxt.load_sync().read_bytes() == b"now bytes"


@pytest.mark.parametrize("codec", ["gzip", "zstd", "none"])
def test_every_codec_round_trips_and_is_detected_from_the_bytes(tmp_path, codec):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "ckpt"
    Checkpoint(dest, codec=codec).save_sync(src)
    with Checkpoint(tmp_path / "x", dest) as nxt:
        assert snapshot(nxt.load_sync()) == snapshot(src)


# -- load ---------------------------------------------------------------------------------------------


def test_load_without_source_returns_none(store):
    with Checkpoint(store.url("ckpt"), storage_options=store.storage_options) as cp:
        assert cp.remote_source is None
        assert not cp.prev_exists()
        assert cp.load_sync() is None


def test_load_when_nothing_was_saved_returns_none(store):
    with Checkpoint(store.url("b"), store.url("never-written"), storage_options=store.storage_options) as cp:
        assert not cp.prev_exists()
        assert cp.load_sync() is None


def test_second_load_returns_same_result_without_downloading(store, tmp_path):
    dest = store.url("ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(b"once")
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as nxt:
        first = nxt.load_sync()
        store.fs().rm(store.fs()._strip_protocol(dest))  # a second download would now find nothing
        assert nxt.load_sync() == first
        assert first.read_bytes() == b"once"


def test_loaded_path_survives_garbage_collection_of_the_checkpoint(tmp_path):
    dest = tmp_path / "ckpt"
    Checkpoint(dest).save_sync(b"kept")
    p = Checkpoint(tmp_path / "x", dest).load_sync()
    gc.collect()
    assert p.read_bytes() == b"kept"


# -- construction ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("src", ["", "   ", "''", '"  "', "{{.prevCheckpointPrefix}}", " '{{ .Prev }}' "])
def test_empty_or_template_source_means_no_previous_checkpoint(tmp_path, src):
    with Checkpoint(tmp_path / "d", src) as cp:
        assert cp.remote_source is None
        assert cp.load_sync() is None


def test_source_is_stripped_of_whitespace_and_quotes(tmp_path):
    dest = tmp_path / "prev"
    Checkpoint(dest).save_sync(b"x")
    with Checkpoint(tmp_path / "d", f"  '{dest}'\n") as cp:
        assert cp.remote_source == str(dest)
        assert cp.load_sync().read_bytes() == b"x"


def test_pathlike_and_file_urls_are_accepted(tmp_path):
    Checkpoint(f"file://{tmp_path}/a").save_sync(b"via file url")
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp:
        assert cp.remote_destination == str(tmp_path / "b")
        assert cp.load_sync().read_bytes() == b"via file url"


def test_chained_url_source_loads(tmp_path):
    Checkpoint(tmp_path / "a").save_sync(b"chained")
    with Checkpoint(tmp_path / "b", f"simplecache::file://{tmp_path}/a") as cp:
        assert cp.load_sync().read_bytes() == b"chained"


@pytest.mark.parametrize("dest", [None, 5, b"bytes-uri"])
def test_destination_of_wrong_type_raises_type_error(dest):
    with pytest.raises(TypeError, match="checkpoint_dest"):
        Checkpoint(dest)


@pytest.mark.parametrize("dest", ["", "  ", "s3://b/{{.checkpointPrefix}}"])
def test_empty_or_template_destination_raises_value_error(dest):
    with pytest.raises(ValueError, match="checkpoint_dest"):
        Checkpoint(dest)


def test_unknown_codec_raises_value_error_listing_codecs(tmp_path):
    with pytest.raises(ValueError, match="gzip"):
        Checkpoint(tmp_path / "d", codec="lz4")


def test_checkpoint_is_a_base_checkpoint():
    assert issubclass(Checkpoint, BaseCheckpoint)
    with pytest.raises(TypeError):
        BaseCheckpoint()  # type: ignore[abstract]


# -- bad data ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [42, None, 3.5, ["a"], {"a": 1}, object()])
def test_save_of_unsupported_type_raises_type_error_listing_accepted_types(tmp_path, data):
    with Checkpoint(tmp_path / "d") as cp, pytest.raises(TypeError, match="bytes, bytearray, memoryview"):
        cp.save_sync(data)
    assert not (tmp_path / "d").exists()


def test_save_of_str_naming_nothing_says_to_pass_bytes(tmp_path):
    with Checkpoint(tmp_path / "d") as cp, pytest.raises(FileNotFoundError, match=r"pass bytes"):
        cp.save_sync("step 10 of 100")


def test_save_of_missing_pathlike_raises_file_not_found(tmp_path):
    with Checkpoint(tmp_path / "d") as cp, pytest.raises(FileNotFoundError):
        cp.save_sync(tmp_path / "missing")


def test_fifo_and_socket_inside_directory_are_skipped_with_a_warning(tmp_path):
    import socket

    src = make_tree(tmp_path / "src")
    os.mkfifo(src / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "sock"))
    try:
        with pytest.warns(UserWarning, match="skipped (fifo|socket)") as caught:
            Checkpoint(tmp_path / "ckpt").save_sync(src)
        assert len(caught) == 2
    finally:
        sock.close()
    with Checkpoint(tmp_path / "x", tmp_path / "ckpt") as nxt:
        loaded = nxt.load_sync()
        assert not (loaded / "pipe").exists() and not (loaded / "sock").exists()
        assert (loaded / "state.json").exists()


def test_fifo_given_directly_raises_value_error(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with Checkpoint(tmp_path / "d") as cp, pytest.raises(ValueError, match="neither a regular file"):
        cp.save_sync(tmp_path / "pipe")


# "../src/state.json" leaves the tree and comes back in by the root's own name: a load refuses such a link (it is
# read lexically, never through the names around the workspace), so a save refuses it too.
@pytest.mark.parametrize("target", ["/etc/passwd", "../outside.txt", "../src/state.json"])
def test_symlink_leaving_the_tree_is_refused_at_save(tmp_path, target):
    src = make_tree(tmp_path / "src")
    (tmp_path / "outside.txt").write_text("x")
    os.symlink(target, src / "escape")
    dest = tmp_path / "ckpt"
    Checkpoint(dest).save_sync(b"previous")
    with pytest.raises(ValueError, match="points outside"):
        Checkpoint(dest).save_sync(src)
    assert dest.read_bytes() == b"previous"
    with CheckpointManager(tmp_path / "steps", dedup=True) as manager:  # the same walk and check
        with pytest.raises(ValueError, match="points outside"):
            manager.save(src, 1)
        assert manager.steps() == []


# -- workspace ------------------------------------------------------------------------------------------


def test_each_checkpoint_gets_its_own_workspace_removed_by_close(tmp_path):
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()
    a.close()
    a.close()
    assert not a.path.exists() and b.path.exists()
    with pytest.raises(taskpoint.CheckpointError, match="closed"):
        a.save_sync(b"x")
    with b:
        pass
    assert not b.path.exists()


def test_given_workspace_is_used_kept_and_not_shared(tmp_path):
    ws = tmp_path / "ws"
    Checkpoint(tmp_path / "prev").save_sync(b"data")
    cp = Checkpoint(tmp_path / "d", tmp_path / "prev", workspace=ws)
    assert cp.path == ws
    with pytest.raises(ValueError, match="already used"):
        Checkpoint(tmp_path / "e", workspace=ws)
    assert cp.load_sync() == ws / "payload"
    cp.close()
    assert (ws / "payload").read_bytes() == b"data"
    Checkpoint(tmp_path / "e", workspace=ws).close()  # free again after close


@pytest.mark.e2e("starts a python process")
def test_workspace_is_removed_at_interpreter_exit(tmp_path):
    code = (
        "import taskpoint, sys\n"
        f"cp = taskpoint.Checkpoint({str(tmp_path / 'd')!r})\n"
        "print(cp.path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip())
    assert path.name.startswith("taskpoint-")
    assert not path.exists()


@pytest.mark.e2e("starts a python process")
def test_import_does_not_load_cloud_sdks_or_jax():
    code = (
        "import sys, taskpoint\n"
        "bad = [m for m in ('s3fs', 'gcsfs', 'adlfs', 'jax', 'botocore', 'azure') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_destination_and_manifest_are_the_only_objects_written(store, tmp_path):
    dest = store.url("run", "1", "ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(make_tree(tmp_path / "t"))
    fs = store.fs()
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(fs._strip_protocol(store.url("run", "1")), detail=False))
    assert names == ["ckpt", "ckpt.taskpoint.json"]
    assert object_exists(dest, store.storage_options)


def test_load_of_foreign_raw_object_without_record_returns_payload(store):
    write_object(store.url("raw"), store.storage_options, b"written by someone else")
    with Checkpoint(store.url("x"), store.url("raw"), storage_options=store.storage_options) as cp:
        assert cp.load_sync().read_bytes() == b"written by someone else"


def test_large_checkpoint_round_trips_through_concurrent_ranged_reads(remote_store, tmp_path, monkeypatch):
    from taskpoint.storage import streams as _storage

    opened = []
    real = _storage.ConcurrentRangeReader.__init__

    def spy(self, *args, **kwargs):
        opened.append(args[1])
        real(self, *args, **kwargs)

    monkeypatch.setattr(_storage.ConcurrentRangeReader, "__init__", spy)
    src = make_tree(tmp_path / "src", big=24 << 20)
    dest = remote_store.url("big")
    Checkpoint(dest, storage_options=remote_store.storage_options).save_sync(src)
    with Checkpoint(remote_store.url("next"), dest, storage_options=remote_store.storage_options) as nxt:
        assert snapshot(nxt.load_sync()) == snapshot(src)
    assert len(opened) == 1  # the large object came down as concurrent ranges
    blob = bytearray(read_object(dest, remote_store.storage_options))
    blob[len(blob) * 3 // 4] ^= 0x10
    write_object(dest, remote_store.storage_options, bytes(blob))
    with Checkpoint(remote_store.url("n2"), dest, storage_options=remote_store.storage_options) as nxt, \
            pytest.raises(taskpoint.CheckpointCorruptError):
        nxt.load_sync()


def test_a_file_saved_to_local_disk_is_copied_by_the_kernel_and_recorded_with_its_crc32(tmp_path, monkeypatch):
    import zlib

    from taskpoint import transfer

    copied = []
    real = transfer.copy_fd_in_kernel

    def spy(source_fd, dest_fd, size=None, **kwargs):  # calls through: only records that the kernel path ran
        copied.append(os.readlink(f"/proc/self/fd/{source_fd}"))
        return real(source_fd, dest_fd, size, **kwargs)

    monkeypatch.setattr(transfer, "copy_fd_in_kernel", spy)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(3 << 20))
    with Checkpoint(tmp_path / "store" / "ckpt") as cp:
        cp.save_sync(weights)
    assert copied == [str(weights)]
    record = json.loads((tmp_path / "store" / "ckpt.taskpoint.json").read_bytes())["objects"][0]
    assert record["crc32"] == f"{zlib.crc32(weights.read_bytes()):08x}" and record["size"] == 3 << 20
    with Checkpoint(tmp_path / "d2", tmp_path / "store" / "ckpt") as cp:
        assert cp.load_sync().read_bytes() == weights.read_bytes()


def test_a_local_file_that_changes_size_while_saved_is_refused_and_the_old_checkpoint_stays(tmp_path):
    dest = tmp_path / "store" / "ckpt"
    with Checkpoint(dest) as cp:
        cp.save_sync(b"good")
    proc_file = Path("/proc/self/status")  # stat says 0 bytes, reading gives more: a file that "grew"
    if not proc_file.is_file():
        pytest.skip("no /proc here")
    with Checkpoint(dest) as cp, pytest.raises(RuntimeError, match="changed size"):
        cp.save_sync(proc_file)
    with Checkpoint(tmp_path / "d2", dest) as cp:
        assert cp.load_sync().read_bytes() == b"good"
