"""In a manager's steps, gzip members that do not compress are stored (deflate's stored blocks): still standard
gzip, one member per 4 MiB with its CRC32 and size, read by any gzip reader, every byte still verified. A single
Checkpoint's archive compresses every member, as it always did."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointManager
from taskpoint.format import pgzip


def weights(n_bytes: int, seed: int = 0) -> bytes:
    """float32 N(0, 0.02): what model weights look like to a compressor (about 0.93 of their size)."""
    return np.random.default_rng(seed).normal(0, 0.02, n_bytes // 4).astype(np.float32).tobytes()


def text(n_bytes: int) -> bytes:
    return b"".join(f"step {i} loss {1 / (i + 1):.6f} lr 0.001\n".encode() for i in range(n_bytes // 30))[:n_bytes]


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> int:
        self.data += b
        return len(b)


def members(stream: bytes) -> list[tuple[int, int]]:
    """(stored length, input size) of each labelled member of ``stream``."""
    out, pos = [], 0
    while pos < len(stream):
        length = pgzip.labelled_length(stream[pos:pos + 32])
        assert length is not None
        out.append((length, int.from_bytes(stream[pos + length - 4:pos + length], "little")))
        pos += length
    return out


def compress(data: bytes, level: int | None = None, store: bool = True) -> bytes:
    sink = Sink()
    writer = pgzip.ParallelGzipWriter(sink, level, store=store)  # type: ignore[arg-type]
    writer.write(data)
    writer.close()
    return bytes(sink.data)


@pytest.mark.parametrize("level", [None, 1, 9])
def test_members_that_do_not_compress_are_stored_and_the_others_compressed(level):
    size = pgzip.MEMBER_SIZE
    data = weights(2 * size) + text(2 * size) + os.urandom(size)
    stream = compress(data, level)
    found = members(stream)
    assert [isize for _, isize in found] == [size] * 5
    stored = [length for length, isize in found if length > isize]
    assert len(stored) == 3 and all(length < size * 1.001 for length in stored)  # weights, random: stored
    assert all(length < size * 0.2 for length, _ in found[2:4])  # the log: compressed
    assert gzip.decompress(stream) == data  # any gzip reader
    reader = pgzip.ParallelGzipReader(io.BytesIO(stream))
    assert reader.read() == data


def test_without_store_every_member_is_compressed():
    data = weights(2 * pgzip.MEMBER_SIZE)
    assert all(length < 0.95 * isize for length, isize in members(compress(data, store=False)))


def test_a_damaged_stored_member_fails_its_crc32():
    stream = bytearray(compress(weights(pgzip.MEMBER_SIZE)))
    stream[len(stream) // 2] ^= 0x01
    with pytest.raises(pgzip.GzipFormatError, match="CRC32"):
        pgzip.ParallelGzipReader(io.BytesIO(bytes(stream))).read()


def save_tree(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(weights(9 << 20, seed))
    (folder / "train.log").write_bytes(text(3 << 20))
    return folder


def same_tree(a: Path, b: Path) -> bool:
    return all((a / name).read_bytes() == (b / name).read_bytes() for name in ("model.bin", "train.log"))


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_a_step_of_weights_and_a_log_round_trips_and_any_gzip_reader_opens_it(store, tmp_path):
    source = save_tree(tmp_path / "run", 1)
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options) as m:
        m.save(source, 1)
        assert same_tree(m.restore(1), source)
        stored = m.describe(1).size
        assert 9 << 20 < stored < (9 << 20) * 1.01 + (3 << 20) * 0.3  # weights stored, the log compressed
    if store.kind == "local":  # what Flyte (tarfile "r:gz") makes of it
        (payload,) = (Path(store.url("steps")) / "ckpt-1").glob("payload-*")
        with tarfile.open(payload, "r:gz") as tar:
            tar.extractall(tmp_path / "flyte", filter="data")
        assert same_tree(tmp_path / "flyte", source)


def test_a_flipped_byte_in_a_stored_member_is_damage_and_fallback_restores_the_older_step(tmp_path):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(save_tree(tmp_path / "a", 1), 1)
        m.save(save_tree(tmp_path / "b", 2), 2)
        (payload,) = (tmp_path / "steps" / "ckpt-2").glob("payload-*")
        data = bytearray(payload.read_bytes())
        data[5 << 20] ^= 0x01  # inside the weights, in a stored member
        payload.write_bytes(bytes(data))
        with pytest.raises(CheckpointCorruptError, match="step 2"):
            m.restore(2)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert same_tree(m.restore(fallback=True), tmp_path / "a") and m.restored_step == 1


def test_steps_whose_members_were_all_compressed_still_restore(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path / "steps") as m:
        with monkeypatch.context() as patch:  # what taskpoint wrote before it stored members
            patch.setattr(pgzip, "STORE_ABOVE", 2.0)
            m.save(save_tree(tmp_path / "a", 1), 1)
        m.save(save_tree(tmp_path / "b", 2), 2)
        assert m.describe(1).size < m.describe(2).size  # every member of step 1 compressed
        assert same_tree(m.restore(1), tmp_path / "a") and same_tree(m.restore(2), tmp_path / "b")


def test_a_single_checkpoint_still_compresses_its_weights(tmp_path):
    source = save_tree(tmp_path / "run", 1)
    Checkpoint(tmp_path / "cp").save_sync(source)
    assert (tmp_path / "cp").stat().st_size < 9 << 20  # less than the weights alone: compressed, as always
    with Checkpoint(tmp_path / "out", tmp_path / "cp") as cp:
        assert same_tree(cp.load_sync(), source)
