"""One file of a step or checkpoint opened for reading (CheckpointManager.open, Checkpoint.open): random seeks and
reads return the file's bytes, torch.load and safetensors read it, and only the members or chunks that hold the
bytes asked for cross the wire (counted through a proxy in front of the S3 server)."""

from __future__ import annotations

import io
import json
import os
import random

import fsspec
import pytest

from _fault_proxy import FaultProxy
from helpers import make_tree
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointManager
from taskpoint.format.fileset import PIECE_SIZE
from taskpoint.format.index import ArchiveIndex

LOCAL_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
#: Three 4 MiB gzip members, and four 4 MiB chunks of a deduplicated step.
BULK = 13_000_000


def _random_reads(f: io.BufferedReader, data: bytes, rng: random.Random) -> None:
    assert f.seekable() and f.readable()
    for _ in range(25):
        at, n = rng.randrange(len(data)), rng.choice([1, 17, 4096, 1 << 20, 5 << 20])
        assert f.seek(at) == at and f.tell() == at
        assert f.read(n) == data[at:at + n]
    buf = bytearray(1000)
    f.seek(-500, os.SEEK_END)
    assert f.readinto(buf) == 500 and bytes(buf[:500]) == data[-500:]
    assert f.read() == b"" and f.tell() == len(data)
    f.seek(0)
    assert f.read() == data


@LOCAL_S3
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_manager_open_reads_the_same_bytes_as_the_file(store, tmp_path, dedup):
    src = make_tree(tmp_path / "src", big=BULK)
    data = (src / "bulk.bin").read_bytes()
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=dedup) as mgr:
        mgr.save(src, 3, blocking=True)
        with mgr.open(3, "bulk.bin") as f:
            _random_reads(f, data, random.Random(3))
        with mgr.open(3, "nested/deeper/notes.txt") as f:
            assert f.read() == b"deep"
        with pytest.raises(KeyError, match="'nested/nope'"):
            mgr.open(3, "nested/nope")
        with pytest.raises(IsADirectoryError):
            mgr.open(3, "nested")
        with pytest.raises(FileNotFoundError):
            mgr.open(4, "bulk.bin")


@LOCAL_S3
@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_checkpoint_open_reads_the_same_bytes_as_the_file(store, tmp_path, codec):
    src = make_tree(tmp_path / "src", big=BULK)
    data = (src / "bulk.bin").read_bytes()
    Checkpoint(store.url("ckpt"), storage_options=store.storage_options, codec=codec).save_sync(src)
    cp = Checkpoint(store.url("next"), store.url("ckpt"), storage_options=store.storage_options)
    with cp.open("bulk.bin") as f:
        _random_reads(f, data, random.Random(4))
    with pytest.raises(KeyError, match=r"'weights\.pt'"):
        cp.open("weights.pt")


def test_a_damaged_member_raises_when_its_bytes_are_read(tmp_path):
    src = make_tree(tmp_path / "src", big=BULK)
    Checkpoint(tmp_path / "ckpt").save_sync(src)
    index = ArchiveIndex.from_json(json.loads((tmp_path / "ckpt.taskpoint.json").read_text())["objects"][0]["index"])
    span = index.span(1)
    with open(tmp_path / "ckpt", "r+b") as f:
        f.seek(span.stored + 1000)
        f.write(b"\x00" * 8)
    data = (src / "bulk.bin").read_bytes()
    with Checkpoint(tmp_path / "n", tmp_path / "ckpt").open("bulk.bin") as f:
        assert f.read(1 << 20) == data[: 1 << 20]  # member 0 is intact
        f.seek(span.plain - index.entries[0].data + 10)
        with pytest.raises(CheckpointCorruptError, match="member 1"):
            f.read(100)


def test_torch_load_and_safetensors_read_an_opened_file(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {"w": torch.randn(512, 1024), "b": torch.arange(1000)}
    (tmp_path / "model").mkdir()
    torch.save(state, tmp_path / "model" / "model.pt")
    safetensors_torch.save_file(state, tmp_path / "model" / "model.safetensors")
    with CheckpointManager(tmp_path / "m") as mgr:
        mgr.save(tmp_path / "model", 1, blocking=True)
        loaded = torch.load(mgr.open(1, "model.pt"), weights_only=True)
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
        with mgr.open(1, "model.safetensors") as f:
            tensors = safetensors_torch.load(f.read())
        assert all(torch.equal(tensors[k], state[k]) for k in state)


class _CountingProxy(FaultProxy):
    """A proxy that lets every request through and counts the body bytes it passes (GETs: the responses')."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.passed: list[int] = []  # list.append is atomic: connections are served on several threads

    def _pass(self, sock: object, data: bytes, rate: float | None = None) -> None:
        self.passed.append(len(data))
        super()._pass(sock, data, rate)  # type: ignore[arg-type]


def _stored_bytes(index: ArchiveIndex, name: str) -> int:
    entry = next(e for e in index.entries if e.name == name)
    return sum(s.stored_length for s in index.spans(entry.data, entry.data + entry.size))


def _piece_bytes(index: ArchiveIndex, name: str, size: int) -> int:
    """The stored bytes of the BLAKE3 pieces (of an object of ``size``) that hold ``name``'s members: what a
    partial restore of a payload step reads, each piece checked whole (manifest version 7)."""
    entry = next(e for e in index.entries if e.name == name)
    pieces = {i for s in index.spans(entry.data, entry.data + entry.size)
              for i in range(s.stored // PIECE_SIZE, (s.stored + s.stored_length - 1) // PIECE_SIZE + 1)}
    return sum(min(PIECE_SIZE, size - i * PIECE_SIZE) for i in pieces)


@pytest.mark.e2e("starts the S3 server")
def test_reading_one_file_fetches_at_most_its_members_and_the_index(s3_server, tmp_path):
    src = make_tree(tmp_path / "src", big=BULK)
    (src / "second.bin").write_bytes(os.urandom(9_000_000))  # after bulk.bin: in members of its own, mostly
    wanted = (src / "second.bin").read_bytes()
    options = s3_server.storage_options
    root = f"s3://{s3_server.bucket}/{os.urandom(6).hex()}"
    with CheckpointManager(f"{root}/m", storage_options=options) as mgr:
        mgr.save(src, 1, blocking=True)
    Checkpoint(f"{root}/c", storage_options=options).save_sync(src)
    fs = fsspec.filesystem("s3", **options)
    step_manifest = json.loads(fs.cat_file(f"{root}/m/ckpt-1/taskpoint.json"))
    step_index = step_manifest["index"]
    record_index = json.loads(fs.cat_file(f"{root}/c.taskpoint.json"))["objects"][0]["index"]
    with _CountingProxy(s3_server.endpoint) as proxy:
        through = {**options, "endpoint_url": proxy.url}
        with CheckpointManager(f"{root}/m", storage_options=through) as mgr:
            got = mgr.restore(1, into=tmp_path / "m-out", paths=["second.bin"])
        assert (got / "second.bin").read_bytes() == wanted
        stored = _stored_bytes(ArchiveIndex.from_json(step_index), "second.bin")
        pieces = _piece_bytes(ArchiveIndex.from_json(step_index), "second.bin", step_manifest["size"])
        read, manifest = sum(proxy.passed), len(fs.cat_file(f"{root}/m/ckpt-1/taskpoint.json"))
        assert stored < 10_000_000 and read <= 1.1 * pieces + manifest, (read, pieces, manifest)
        proxy.passed.clear()
        with Checkpoint(f"{root}/n", f"{root}/c", storage_options=through).open("second.bin") as f:
            assert f.read() == wanted
        stored = _stored_bytes(ArchiveIndex.from_json(record_index), "second.bin")
        read, record = sum(proxy.passed), len(fs.cat_file(f"{root}/c.taskpoint.json"))
        assert read <= 1.1 * stored + record, (read, stored, record)
