"""A manager step's restore leaves the CRC32 of stored gzip members to the BLAKE3 pieces of the stored object, which
cover the same bytes and are checked before anything is published; every byte is still checked, and damage that
reaches the archive's reader unchecked by a CRC32 is still refused as damage, naming the piece."""

from __future__ import annotations

import io
import os
import random
import warnings
from pathlib import Path

import pytest

from taskpoint import CheckpointCorruptError, CheckpointManager
from taskpoint.format import pgzip
from test_stored_members import compress, text, weights


def stream_of(data: bytes) -> bytearray:
    return bytearray(compress(data, store=True))


def read(stream: bytes, hashed: bool) -> bytes:
    with pgzip.ParallelGzipReader(io.BytesIO(stream), hashed=hashed) as reader:
        return reader.read()


def test_a_hashed_reader_leaves_a_stored_members_crc32_to_the_caller_and_checks_everything_else() -> None:
    size = pgzip.MEMBER_SIZE
    data = weights(size) + text(size)
    stream = stream_of(data)
    stored_length = pgzip.labelled_length(bytes(stream[:32]))
    assert stored_length is not None and stored_length > size  # the weights: stored; the log: compressed

    in_stored = bytearray(stream)
    in_stored[stored_length // 2] ^= 0x01
    with pytest.raises(pgzip.GzipFormatError, match="CRC32"):
        read(bytes(in_stored), hashed=False)
    assert read(bytes(in_stored), hashed=True) != data  # the caller's digest is what refuses it

    in_compressed = bytearray(stream)
    in_compressed[-6] ^= 0x01  # the last member's CRC32: an inflated member's output is still checked
    in_length = bytearray(stream)
    in_length[stored_length - 2] ^= 0x01  # a stored member's ISIZE
    for damaged in (in_compressed, in_length):
        for hashed in (False, True):
            with pytest.raises(pgzip.GzipFormatError):
                read(bytes(damaged), hashed=hashed)
    assert read(bytes(stream), hashed=True) == data


def save_two_steps(tmp_path: Path, name: str) -> tuple[CheckpointManager, Path, Path]:
    """Steps 1 and 2 of a folder holding ``name``: 6 MiB of weights (the first gzip member, stored, holds its
    headers and data)."""
    manager = CheckpointManager(tmp_path / "steps")
    for step in (1, 2):
        source = tmp_path / f"run{step}"
        (source / name).parent.mkdir(parents=True)
        (source / name).write_bytes(weights(6 << 20, step))
        manager.save(source, step)
    (payload,) = (tmp_path / "steps" / "ckpt-2").glob("payload-*")
    return manager, payload, tmp_path / "run1"


def damage(payload: Path, find: bytes, offset: int, value: int) -> None:
    data = bytearray(payload.read_bytes())
    at = data.index(find) + offset
    data[at] = value
    payload.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["data", "header", "name"])
def test_damage_in_a_stored_member_is_refused_as_damage_of_its_piece(tmp_path: Path, where: str) -> None:
    """In a file's bytes (the digest refuses them after the extraction), in a tar header (whose own checksum
    refuses it), or in a pax name that turns unsafe (``.a`` into ``..``): each refused as damage of piece 0 (the first),
    nothing lands in the target, and ``fallback`` restores the older step."""
    name = ".a/" + "w" * 120 + ".bin"  # longer than a tar header's name field: it goes in a pax record
    manager, payload, older = save_two_steps(tmp_path, name)
    if where == "data":
        damage(payload, b"path=.a/", 4 << 20, 0)
    elif where == "header":
        damage(payload, b"ustar", -200, ord("x"))  # in the name field of the first header
    else:
        damage(payload, b"path=.a/", len("path=."), ord("."))
    target = tmp_path / "out"
    with manager:
        with pytest.raises(CheckpointCorruptError) as refused:
            manager.restore(2, into=target)
        assert type(refused.value) is CheckpointCorruptError
        assert f"step 2 in {manager.directory} is damaged: piece 0 of {payload.name}" in str(refused.value)
        assert "does not match the blake3 recorded when it was saved" in str(refused.value)
        assert not target.exists() or not os.listdir(target)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            restored = manager.restore(fallback=True)
        assert manager.restored_step == 1
        assert (restored / name).read_bytes() == (older / name).read_bytes()


def test_a_byte_changed_anywhere_in_a_step_of_stored_members_is_refused_as_damage(tmp_path: Path) -> None:
    """Anywhere: gzip headers and labels, stored blocks' headers, tar headers, data, trailers. Each restore raises
    CheckpointCorruptError itself (never an unsafe archive, a missing file or a full disk) and lands nothing."""
    manager, payload, _ = save_two_steps(tmp_path, "model.bin")
    original = payload.read_bytes()
    rng = random.Random(42)
    positions = [0, 3, 12, 19, 20, 24, 512 + 100, len(original) - 1, len(original) - 6]
    positions += rng.sample(range(len(original)), 24)
    with manager:
        for position in positions:
            data = bytearray(original)
            data[position] ^= 1 << rng.randrange(8)
            payload.write_bytes(bytes(data))
            target = tmp_path / f"out-{position}"
            with pytest.raises(CheckpointCorruptError) as refused:
                manager.restore(2, into=target)
            assert type(refused.value) is CheckpointCorruptError, (position, refused.value)
            assert "step 2" in str(refused.value) and "damaged" in str(refused.value), (position, refused.value)
            assert not target.exists() or not os.listdir(target), position
