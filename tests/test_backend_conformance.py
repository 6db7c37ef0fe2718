"""The backend conformance suite (issue 22): what taskpoint needs of a store, written once and run on every store.

Each test here runs on every kind of store the suite starts (local disk, ``memory://``, moto's S3 through s3fs
and through obstore, SeaweedFS, the GCS emulator and azurite): first the storage layer's contract
(:class:`taskpoint.storage.Location`: absence is "nothing", never an error; writes land whole; streaming writes
that span several parts; conditional writes; listings; removal), then one end-to-end pass of each layer above
it that talks to a store in its own way (a single checkpoint of each payload kind, damage caught on load, and a
manager's steps with retention, verification and deletion).

The test modules above this one then run their matrices (every damage case, every payload kind, every
retention rule) on the stores whose *read paths* differ (``read_path_store`` in tests/conftest.py: local disk,
``memory://``, s3fs and obstore), where the store does not change what is being tested; this module is what
keeps every backend's own code covered.
"""

from __future__ import annotations

import os

import pytest

from _servers import StoreLocation
from helpers import make_tree, read_object, snapshot, write_object
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointManager
from taskpoint.storage import Location
from taskpoint.storage.backends import Kind
from taskpoint.storage.streams import VersionConflict

MiB = 2**20


def _location(store: StoreLocation, *parts: str) -> Location:
    return Location(store.url(*parts), store.storage_options)


# -- the storage layer's contract ---------------------------------------------------------------------------


def test_absence_is_nothing_and_never_an_error(store: StoreLocation) -> None:
    missing = _location(store, "no", "such", "object")
    assert missing.exists() is False
    assert missing.size() is None
    assert missing.kind() is Kind.NOTHING
    assert missing.read_small() is None
    assert missing.read_versioned() == (None, None)
    assert missing.list_tree() == {}
    assert missing.list_names() == []
    missing.remove()  # removing what is not there is fine
    assert missing.container_missing() is False  # the bucket is there; only the object is not


def test_small_writes_land_whole_and_read_back(store: StoreLocation) -> None:
    loc = _location(store, "dir", "small.bin")
    data = os.urandom(1000)
    loc.write_small(data)
    assert loc.read_small() == data
    assert loc.size() == len(data)
    assert loc.exists() and loc.kind() is Kind.OBJECT
    folder = _location(store, "dir")
    assert folder.kind() is Kind.FOLDER and not folder.exists()  # a folder or prefix is not an object
    loc.write_small(b"replaced")
    assert loc.read_small() == b"replaced"


def test_a_streamed_write_of_several_parts_reads_back_in_pieces(store: StoreLocation) -> None:
    loc = _location(store, "large.bin")
    data = os.urandom(12 * MiB + 3)  # more than two 5 MiB parts: multipart and resumable uploads
    with loc.open_write(size_hint=len(data)) as f:
        for start in range(0, len(data), MiB):
            f.write(data[start:start + MiB])
    assert loc.size() == len(data)
    with loc.open_read(size_hint=len(data)) as f:
        pieces = []
        while piece := f.read(3 * MiB + 7):
            pieces.append(piece)
    assert b"".join(pieces) == data


def test_a_write_that_fails_midway_leaves_the_previous_object(store: StoreLocation) -> None:
    loc = _location(store, "kept.bin")
    loc.write_small(b"the previous object")

    class Boom(Exception):
        pass

    with pytest.raises(Boom), loc.open_write() as f:
        f.write(os.urandom(6 * MiB))
        raise Boom
    assert loc.read_small() == b"the previous object"


def test_conditional_writes_refuse_a_stale_version(store: StoreLocation) -> None:
    loc = _location(store, "record.json")
    first = loc.write_versioned(b"one", None)
    data, version = loc.read_versioned()
    assert data == b"one"
    if not loc.conditional:
        assert first is None  # a plain atomic write where the store has no conditional writes
        return
    assert version == first
    second = loc.write_versioned(b"two", version)
    assert loc.read_small() == b"two"
    with pytest.raises(VersionConflict):
        loc.write_versioned(b"stale", version)  # written against the first version: refused
    with pytest.raises(VersionConflict):
        loc.write_versioned(b"create", None)  # "only if nothing is there": something is
    assert loc.read_versioned() == (b"two", second)


def test_listings_see_every_object_below_and_removal_empties_them(store: StoreLocation) -> None:
    names = ["a/1.bin", "a/2.bin", "a/sub/3.bin", "ab.bin", "b.bin"]
    for name in names:
        _location(store, "tree", name).write_small(name.encode())
    tree = _location(store, "tree")

    def objects(listed: dict[str, dict]) -> dict[str, int]:
        """The objects of a listing (folders and prefixes left out) by path below ``tree``, with their sizes."""
        root = tree.path.rstrip("/") + "/"
        return {name.removeprefix(root): info["size"] for name, info in listed.items()
                if info.get("type") == "file"}

    assert objects(tree.list_tree()) == {name: len(name) for name in names}
    # A prefix names the first level (as the manager lists ``ckpt-``): the entries whose names start with it.
    assert objects(tree.list_tree(prefix="a")) == {name: len(name) for name in names if name.startswith("a")}
    assert sorted(tree.list_names()) == ["a", "ab.bin", "b.bin"]
    for name in names:
        _location(store, "tree", name).remove()
    _location(store, "tree", "a", "sub").remove_empty_folder()
    assert objects(tree.list_tree()) == {}


# -- each layer above, once per store --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bytes", "file", "directory"])
def test_a_checkpoint_of_each_kind_round_trips_and_damage_is_caught(store: StoreLocation, tmp_path, kind) -> None:
    if kind == "bytes":
        data: object = os.urandom(300_000)
    elif kind == "file":
        data = tmp_path / "model.bin"
        data.write_bytes(os.urandom(300_000))
    else:
        data = make_tree(tmp_path / "src", big=300_000)
    dest = store.url("ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(data)
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as cp:
        loaded = cp.load_sync()
        assert loaded is not None
        if kind == "directory":
            assert snapshot(loaded) == snapshot(data)
        else:
            expected = data if kind == "bytes" else data.read_bytes()
            assert loaded == cp.path / "payload" and loaded.read_bytes() == expected
        assert cp.verify(source=True).state == "healthy"
    blob = bytearray(read_object(dest, store.storage_options))
    blob[len(blob) // 2] ^= 0x01
    write_object(dest, store.storage_options, bytes(blob))
    with Checkpoint(store.url("again"), dest, storage_options=store.storage_options) as cp, \
            pytest.raises(CheckpointCorruptError, match="ckpt"):
        cp.load_sync()
    write_object(dest, store.storage_options, bytes(blob[: len(blob) // 3]))
    with Checkpoint(store.url("cut"), dest, storage_options=store.storage_options) as cp, \
            pytest.raises(CheckpointCorruptError):
        cp.load_sync()


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_manager_steps_commit_verify_retain_and_delete(store: StoreLocation, tmp_path, dedup: bool) -> None:
    tree = make_tree(tmp_path / "state", big=200_000)
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options, keep=2, dedup=dedup,
                           preemption=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(os.urandom(50_000) if step != 2 else tree, step, metadata={"step": step})
        assert mgr.steps() == [2, 3]
        assert mgr.verify().healthy
        restored = mgr.restore(2, into=tmp_path / "restored")
        assert snapshot(restored) == snapshot(tree)
        assert mgr.metadata(3) == {"step": 3}
        mgr.delete(2, force=True)
        assert mgr.steps() == [3]
        mgr.gc()  # what the deleted steps left (chunks no step references, for dedup) goes
        assert mgr.verify().healthy
