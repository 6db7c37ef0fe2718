"""The checkpoint record protocol: every visible object has a digest, failed saves never strand a good
checkpoint, a reader during a save sees a verified old or new state, and small saves take few requests.

Kills are real SIGKILLs of real processes, at chosen moments: the child calls through to the real storage
operation and kills itself right before or after it (the only injected part is the moment).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from helpers import make_tree, snapshot
from taskpoint import Checkpoint, CheckpointCorruptError, StorageError
from taskpoint.storage import Location

TIMEOUT = 60

_KILLED_SAVER = """
    import json, os, signal, sys
    from taskpoint import Checkpoint
    from taskpoint.storage import Location

    dest, moment, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    real_write_small, real_replace = Location.write_small, os.replace
    real_write_versioned = Location.write_versioned

    def write_small(self, data, **kwargs):
        real_write_small(self, data, **kwargs)
        if moment == "after-record" and self.uri.endswith(".taskpoint.json"):
            os.kill(os.getpid(), signal.SIGKILL)  # the record lists the new object; the object is not visible

    def write_versioned(self, data, expected, **kwargs):  # records are written conditionally where stores can
        version = real_write_versioned(self, data, expected, **kwargs)
        if moment == "after-record" and self.uri.endswith(".taskpoint.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return version

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if moment == "after-commit" and not str(dst).endswith(".taskpoint.json"):
            os.kill(os.getpid(), signal.SIGKILL)  # the new object is visible; nothing after it ran

    Location.write_small = write_small
    Location.write_versioned = write_versioned
    os.replace = replace
    Checkpoint(dest, storage_options=options).save_sync(b"new state " * 1000)
    sys.exit(3)  # never reached
"""


def _save_and_die(dest: str, moment: str, options: dict[str, Any] | None = None) -> None:
    command = [sys.executable, "-c", textwrap.dedent(_KILLED_SAVER), dest, moment, json.dumps(options or {})]
    out = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == -9, out.stderr


def _load(dest: str, tmp_path: Path, options: dict[str, Any] | None = None) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a verified load warns about nothing
        with Checkpoint(tmp_path / "next", dest, storage_options=options) as cp:
            loaded = cp.load_sync()
            assert loaded is not None
            return loaded.read_bytes()


@pytest.mark.parametrize("moment", ["after-record", "after-commit"])
def test_a_save_killed_around_its_commit_leaves_a_verified_old_or_new_checkpoint(tmp_path, moment):
    dest = str(tmp_path / "store" / "ckpt")
    Checkpoint(dest).save_sync(b"old state")
    _save_and_die(dest, moment)
    expected = b"old state" if moment == "after-record" else b"new state " * 1000
    assert _load(dest, tmp_path) == expected  # verified: no "unverified" warning


def test_damage_after_a_killed_save_is_still_caught(tmp_path):
    """No window without a digest: the old object, still visible after the kill, is checked against its CRC."""
    dest = tmp_path / "store" / "ckpt"
    Checkpoint(dest).save_sync(b"old state, long enough to flip a byte in the middle")
    _save_and_die(str(dest), "after-record")
    data = bytearray(dest.read_bytes())
    data[len(data) // 2] ^= 0x01
    dest.write_bytes(bytes(data))
    with Checkpoint(tmp_path / "next", dest) as cp, pytest.raises(CheckpointCorruptError, match="checksum"):
        cp.load_sync()


def test_the_record_lists_the_new_object_before_it_is_visible(tmp_path):
    dest = tmp_path / "store" / "ckpt"
    Checkpoint(dest).save_sync(b"old state")
    _save_and_die(str(dest), "after-record")
    record = json.loads((tmp_path / "store" / "ckpt.taskpoint.json").read_bytes())
    sizes = [o["size"] for o in record["objects"]]
    assert sizes == [len(b"new state " * 1000), len(b"old state")]
    assert all(o["crc32"] for o in record["objects"])


@contextmanager
def _failing_record_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The record's next write fails as storage does (injected at the storage boundary: a store that takes the
    object but not the record is hard to produce on demand)."""
    real, real_versioned = Location.write_small, Location.write_versioned

    def write_small(self: Location, data: bytes, **kwargs: Any) -> None:
        if self.uri.endswith(".taskpoint.json"):
            raise StorageError(f"could not write {self.uri}: injected outage")
        real(self, data, **kwargs)

    def write_versioned(self: Location, data: bytes, expected: str | None, **kwargs: Any) -> str | None:
        if self.uri.endswith(".taskpoint.json"):  # S3 and GCS write records conditionally
            raise StorageError(f"could not write {self.uri}: injected outage")
        return real_versioned(self, data, expected, **kwargs)

    monkeypatch.setattr(Location, "write_small", write_small)
    monkeypatch.setattr(Location, "write_versioned", write_versioned)
    yield
    monkeypatch.setattr(Location, "write_small", real)
    monkeypatch.setattr(Location, "write_versioned", real_versioned)


class _Failing(Exception):
    pass


def test_failed_saves_never_make_the_last_good_checkpoint_unloadable(store, tmp_path, monkeypatch):
    """Issue 11 item 4: save A; save B fails at its record; save C fails midway: A still loads, verified."""
    from taskpoint.checkpoint import save_object
    from taskpoint.format.codecs import get_codec
    from taskpoint.payloads import BytesPayload

    dest = store.url("ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(b"A")
    with _failing_record_writes(monkeypatch), pytest.raises(StorageError):
        Checkpoint(dest, storage_options=store.storage_options).save_sync(b"B" * 5000)

    class Failing(BytesPayload):
        def write(self, sink, codec, level):
            sink.write(b"C" * 1000)
            raise _Failing("the data source broke")

    with pytest.raises(_Failing):
        save_object(Location(dest, store.storage_options), Failing(b""), get_codec("gzip"), None)
    assert _load(dest, tmp_path, store.storage_options) == b"A"
    Checkpoint(dest, storage_options=store.storage_options).save_sync(b"D")
    assert _load(dest, tmp_path, store.storage_options) == b"D"


@pytest.mark.parametrize("kind", ["local", "s3", "s3-seaweed"])
def test_a_reader_during_saves_sees_one_complete_verified_state(kind, request, tmp_path):
    """Issue 11 item 14: loads racing saves of another writer get the old or the new state, never "damaged"."""
    if kind == "local":
        dest, options = str(tmp_path / "store" / "ckpt"), None
    else:
        server = request.getfixturevalue("seaweed_server" if kind == "s3-seaweed" else "s3_server")
        location = server.new_location()
        dest, options = location.url("ckpt"), location.storage_options
    trees = [make_tree(tmp_path / f"tree{i}", big=(i + 1) * 300_000) for i in range(2)]
    expected = [snapshot(t) for t in trees]
    Checkpoint(dest, storage_options=options).save_sync(trees[0])
    stop, errors, loads = threading.Event(), [], [0]

    def save_forever() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                Checkpoint(dest, storage_options=options).save_sync(trees[i % 2])
            except BaseException as exc:
                errors.append(exc)
                return

    writer = threading.Thread(target=save_forever)
    writer.start()
    try:
        while loads[0] < 25 and not errors:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with Checkpoint(tmp_path / "reader", dest, storage_options=options) as cp:
                    got = snapshot(cp.load_sync())
            assert got in expected
            loads[0] += 1
    finally:
        stop.set()
        writer.join(TIMEOUT)
    assert errors == []


class _RequestCounter:
    """Counts the HTTP requests an s3fs filesystem sends (botocore's own event hook, on the real client)."""

    def __init__(self, fs: Any) -> None:
        fs.connect_refresh = False
        self.requests: list[str] = []
        fs.s3.meta.events.register("before-send.s3", self._sent)

    def _sent(self, request: Any, **kwargs: Any) -> None:
        self.requests.append(f"{request.method} {request.url.split('?')[0].rsplit('/', 1)[-1]}")


@pytest.mark.parametrize("s3_store", ["s3"], indirect=True)  # botocore's event hooks: obstore never passes them
def test_small_saves_and_loads_take_few_requests(s3_store, tmp_path):
    """Issue 11 item 19: a small save of a checkpoint that saved there before takes 2 requests (the record,
    written with If-Match on the ETag it left, and the object); a small load 2. The first save of a new
    checkpoint at a name with a record takes 6 in 3 round trips (issue 44 item 3: the record's read, its create
    refused and the check that the name is no prefix, a HEAD and a listing, together; the record over the version
    read; the object), where it took 3 in 3 while the read came first; the very first save at a new name 5 in 2
    (the same four requests together, the create landing; the object)."""
    dest = s3_store.url("ckpt")
    counter = _RequestCounter(Location(dest, s3_store.storage_options).fs)
    Checkpoint(dest, storage_options=s3_store.storage_options).save_sync(b"w" * 100)
    very_first = list(counter.requests)
    counter.requests.clear()
    writer = Checkpoint(dest, storage_options=s3_store.storage_options)  # knows nothing, as a new process
    writer.save_sync(b"x" * 100)
    first = list(counter.requests)
    counter.requests.clear()
    writer.save_sync(b"y" * 100)
    second = list(counter.requests)
    counter.requests.clear()
    with Checkpoint(tmp_path / "next", dest, storage_options=s3_store.storage_options) as reader:
        assert reader.load_sync().read_bytes() == b"y" * 100
    load = list(counter.requests)
    assert len(very_first) <= 5, very_first
    assert len(first) <= 6, first
    assert first[-2:] == ["PUT ckpt.taskpoint.json", "PUT ckpt"], first  # the record over the version read, the object
    assert len(second) <= 2, second
    assert [r.split()[0] for r in second] == ["PUT", "PUT"], second
    assert len(load) <= 2, load


@pytest.mark.parametrize("store", ["local", "s3", "s3-obstore", "s3-seaweed", "gcs", "azure"], indirect=True)
def test_two_writers_never_drop_each_others_entry(store, tmp_path, monkeypatch):
    """Issue 11, on local disk (a flock of the folder), S3 (If-Match; on moto and SeaweedFS), GCS
    (ifGenerationMatch) and Azure (If-Match): writer A has read the record
    and is about to write it with its new entry when writer B's whole save lands in between. A's record write is
    conditional on the version it saw, so it fails; A reads the record again and keeps B's entry, and B's object,
    made visible last, loads verified. (Before, A's record replaced B's and the load failed as damaged.)"""
    from taskpoint import record

    dest, opts = store.url("shared"), store.storage_options
    writer_a = Checkpoint(dest, storage_options=opts)  # remembers the record it wrote, and its version
    writer_a.save_sync(b"a0")
    real_small, real_versioned = Location.write_small, getattr(Location, "write_versioned", None)
    cut_in = {"done": False}

    def other_writer_saves_now(loc: Location) -> None:
        if loc.uri.endswith(".taskpoint.json") and not cut_in["done"]:
            cut_in["done"] = True
            Checkpoint(dest, storage_options=opts).save_sync(b"bb-1")  # process B knows nothing of A

    def write_small(self: Location, data: bytes, **kwargs: Any) -> None:
        other_writer_saves_now(self)
        real_small(self, data, **kwargs)

    def write_versioned(self: Location, data: bytes, expected: str | None, **kwargs: Any) -> str | None:
        other_writer_saves_now(self)
        assert real_versioned is not None
        return real_versioned(self, data, expected, **kwargs)

    monkeypatch.setattr(Location, "write_small", write_small)
    monkeypatch.setattr(Location, "write_versioned", write_versioned, raising=False)
    writer_a.save_sync(b"a-2")  # process A
    monkeypatch.undo()
    assert cut_in["done"]
    stored = record.read_record(Location(dest, opts).sibling(".taskpoint.json"))
    assert stored is not None and {3, 4} <= {o.size for o in stored.objects}, stored
    Location(dest, opts).fs.pipe_file(Location(dest, opts).path, b"bb-1")  # B's PUT landing last (a slow PUT)
    with Checkpoint(tmp_path / "w", dest, storage_options=opts) as reader:
        assert reader.load_sync().read_bytes() == b"bb-1"


@pytest.mark.parametrize("s3_store", ["s3", "s3-seaweed"], indirect=True)  # botocore's hooks: obstore never passes them
def test_a_small_manager_save_takes_four_requests_and_a_restore_four(s3_store):
    """A save: the existence check, the payload, the check that the payload is still stored just before the
    commit (a sweep may have taken a stalled save's payload for a leftover), the manifest; no listing between
    two listings. A restore: the manifest and the payload, and the PUT and then the DELETE of its lease (which
    keeps the step from other processes' retention while it reads). The lease is written on its own thread, off
    the restore's path (manager/protect.py, RestoreLease), so its PUT may come before or after the reads; its
    DELETE comes last."""
    from taskpoint import CheckpointManager

    with CheckpointManager(s3_store.url("steps"), storage_options=s3_store.storage_options) as m:
        m.save(b"first", 1)  # lists the directory once (retention, leftovers)
        counter = _RequestCounter(Location(s3_store.url("steps"), s3_store.storage_options).fs)
        m.save(b"x" * 100, 2)
        save = list(counter.requests)
        counter.requests.clear()
        assert m.restore(2).read_bytes() == b"x" * 100
        restore = list(counter.requests)
    assert len(save) <= 4, save
    lease = [request for request in restore if request.startswith("PUT ")]
    assert sorted(request.split()[0] for request in restore[:-1]) == ["GET", "GET", "PUT"], restore
    assert lease[0].split()[1].startswith("restore-") and restore[-1] == lease[0].replace("PUT", "DELETE"), restore


def test_retention_between_listings_still_keeps_only_the_newest_steps(s3_store):
    from taskpoint import CheckpointManager

    with CheckpointManager(s3_store.url("steps"), keep=2, storage_options=s3_store.storage_options) as m:
        for step in range(1, 6):
            m.save(str(step).encode(), step)
        assert m.steps() == [4, 5]
