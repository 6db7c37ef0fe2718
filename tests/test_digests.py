"""sha256 behind the writer (taskpoint.digests.HashBehind): the same digest as hashlib's, whatever the pieces."""

from __future__ import annotations

import gc
import hashlib
import os
import threading

from helpers import wait_until
from taskpoint.digests import BATCH_BYTES, HashBehind, streaming_hash
from taskpoint.transfer import HashingWriter


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "taskpoint-hash"]


def test_the_digest_equals_hashlibs_for_pieces_of_every_type_and_size():
    """bytes, bytearray and memoryview pieces, small and larger than a batch, some reused by the caller after
    update() returned (a buffer the writer fills again): the digest is that of the bytes as they were handed."""
    data = os.urandom(3 * BATCH_BYTES + 12345)
    behind, expected = HashBehind(hashlib.sha256), hashlib.sha256()
    buffer = bytearray(70_000)
    at, turn = 0, 0
    while at < len(data):
        size = [1, 1000, 70_000, BATCH_BYTES + 7][turn % 4]
        piece = data[at:at + size]
        if turn % 3 == 1 and len(piece) <= len(buffer):
            buffer[:len(piece)] = piece
            behind.update(memoryview(buffer)[:len(piece)])
            buffer[:len(piece)] = bytes(len(piece))  # the caller reuses its buffer at once
        elif turn % 3 == 1:
            behind.update(memoryview(bytearray(piece)))
        elif turn % 3 == 2:
            behind.update(bytearray(piece))
        else:
            behind.update(piece)
        expected.update(piece)
        at += size
        turn += 1
    assert behind.hexdigest() == expected.hexdigest()
    assert behind.hexdigest() == expected.hexdigest()  # asked twice: the same
    assert HashBehind(hashlib.sha256).hexdigest() == hashlib.sha256().hexdigest()  # nothing hashed


def test_a_small_object_is_hashed_without_a_thread_and_crc32_stays_in_line():
    before = len(_hash_threads())
    small = HashBehind(hashlib.sha256)
    small.update(b"x" * 1000)
    assert len(_hash_threads()) == before
    assert small.hexdigest() == hashlib.sha256(b"x" * 1000).hexdigest()
    assert not isinstance(streaming_hash("crc32"), HashBehind)
    assert isinstance(streaming_hash("sha256"), HashBehind)


def test_a_writer_dropped_midway_ends_its_hashing_thread():
    """A save that fails after some batches went to the thread drops its writer: the thread ends."""
    class Sink:
        def write(self, b: object) -> int:
            return 0

    before = len(_hash_threads())
    writer = HashingWriter(Sink(), "sha256")  # type: ignore[arg-type]
    for _ in range(6):
        writer.write(os.urandom(BATCH_BYTES))
    assert len(_hash_threads()) == before + 1
    del writer
    gc.collect()
    assert wait_until(lambda: len(_hash_threads()) == before)  # the thread hashes what it holds, then ends
