"""The core's piece engine (``taskpoint.pieces``), as it reads a state-dict step's file: the order its pieces are
checked in, reads of pieces no thread has started on, and reads copied by two threads."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from taskpoint import pieces
from taskpoint.format.fileset import PIECE_HASHES, FileEntry, PieceHasher

MIB = 1 << 20


class Damaged(Exception):
    pass


def digests(data: bytes, piece_size: int) -> list[str]:
    return [hashlib.sha256(data[at:at + piece_size]).hexdigest() for at in range(0, len(data), piece_size)]


def entry(size: int, sums: list[str], piece_size: int) -> FileEntry:
    return FileEntry.of_pieces(size, sums, "sha256", piece_size)


def test_the_pieces_of_the_zip_tail_are_checked_first_the_last_first_then_the_rest_from_the_start():
    assert pieces.check_order(10 * MIB + 100, MIB, 11) == [10, 9, *range(9)]  # the tail spans two pieces
    assert pieces.check_order(10 * MIB, MIB, 10) == [9, *range(9)]
    assert pieces.check_order(100, MIB, 1) == [0]
    assert pieces.check_order(0, MIB, 1) == [0]  # an empty file has one piece, of no bytes


def test_a_read_checks_on_its_own_thread_a_piece_no_thread_has_started_on():
    data = bytes(range(40))
    gate, fetched = threading.Event(), []

    def fetch(start: int, length: int) -> bytes:
        fetched.append((start, threading.current_thread() is threading.main_thread()))
        if threading.current_thread() is not threading.main_thread():
            gate.wait(5)  # the reader's threads are busy on the tail's pieces meanwhile
        return data[start:start + length]

    reader = pieces.PieceReader(entry(len(data), digests(data, 4), 4), Damaged, fetch=fetch)
    try:
        assert reader.read(6) == data[:6]
        assert (0, True) in fetched and (4, True) in fetched
    finally:
        gate.set()
        reader.close()


def test_damage_in_a_piece_checked_on_the_reading_thread_is_raised_again_on_each_read():
    data = bytes(range(40))
    sums = digests(data, 4)
    sums[0] = hashlib.sha256(b"other").hexdigest()
    gate = threading.Event()

    def fetch(start: int, length: int) -> bytes:
        if threading.current_thread() is not threading.main_thread():
            gate.wait(5)
        return data[start:start + length]

    reader = pieces.PieceReader(entry(len(data), sums, 4), lambda index: Damaged(index), fetch=fetch)
    try:
        for _ in range(2):
            reader.seek(0)
            with pytest.raises(Damaged) as raised:
                reader.read(3)
            assert raised.value.args == (0,)
        gate.set()
        reader.seek(4)
        assert reader.read(4) == data[4:8]
        with pytest.raises(Damaged):
            reader.verify_all()
    finally:
        gate.set()
        reader.close()


@pytest.mark.parametrize("size", [1000, 1001, 0])
def test_large_local_reads_once_every_piece_checked_return_the_file_bytes(tmp_path, monkeypatch, size):
    monkeypatch.setattr(pieces, "SPLIT_READ", 8)  # every read of 8 bytes or more is copied by two threads
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    reader = pieces.PieceReader(entry(size, digests(data, 64) or [hashlib.sha256().hexdigest()], 64), Damaged,
                                fd=fd, name=str(tmp_path / "f"))
    with reader:
        assert reader.verify_all() == size and reader.name == str(tmp_path / "f")
        for start, length in ((0, size + 50), (3, 7), (3, 8), (size - 9, 9), (size // 2, 301)):
            reader.seek(max(0, start))
            assert reader.read(length) == data[max(0, start):max(0, start) + length]


@pytest.mark.parametrize("piece_hash", ["blake3", "sha256"])
def test_a_file_hashed_while_written_after_and_while_read_has_one_entry(tmp_path, piece_hash):
    data = os.urandom(3 * pieces.HASH_ON_THREADS + 1000)  # writes on the threads and in the caller's thread
    path = tmp_path / "f"
    with open(path, "wb") as sink:
        writer = pieces.PieceWriter(sink, 1 << 20, piece_hash=piece_hash)
        for at, length in ((0, 10), (10, 2 * pieces.HASH_ON_THREADS), (10 + 2 * pieces.HASH_ON_THREADS, len(data))):
            writer.write(data[at:at + length])
        size, digests = writer.finish()
    written = FileEntry.of_pieces(size, digests, piece_hash, 1 << 20)
    assert written == entry_of_pieces(data, piece_hash, 1 << 20)
    assert digests == [PIECE_HASHES[piece_hash](data[at:at + (1 << 20)]).hexdigest() for at in range(0, size, 1 << 20)]
    assert pieces.hash_local(tmp_path, {"f": (size, piece_hash, 1 << 20)})["f"] == written
    with pieces.PieceReader(written, Damaged, fd=os.open(path, os.O_RDONLY)) as reader:
        assert reader.verify_all() == size and reader.read() == data


def entry_of_pieces(data: bytes, piece_hash: str, piece_size: int) -> FileEntry:
    hasher = PieceHasher(piece_hash, piece_size)
    hasher.update(data)
    return hasher.entry()


def test_a_file_listed_whole_is_read_as_one_piece_checked_before_any_byte(tmp_path):
    data = os.urandom(5000)
    whole = FileEntry(len(data), hashlib.sha256(data).hexdigest())
    (tmp_path / "f").write_bytes(data)
    with pieces.PieceReader(whole, Damaged, fd=os.open(tmp_path / "f", os.O_RDONLY)) as reader:
        reader.seek(4000)
        assert reader.read(2000) == data[4000:]
    for damaged in (data[:100] + bytes([data[100] ^ 0xFF]) + data[101:], data + b"!"):  # a byte changed; appended
        (tmp_path / "f").write_bytes(damaged)
        with pieces.PieceReader(whole, lambda index: Damaged(index), fd=os.open(tmp_path / "f", os.O_RDONLY)) \
                as reader, pytest.raises(Damaged) as raised:
            reader.read(1)
        assert raised.value.args == (0,)
