"""A local payload is verified by positional reads (:func:`~taskpoint.digests.pieces_of_file`), never from a memory
map: a file another process truncates while it is read comes up short, and the digest is of the bytes that were
there. Real processes, a real truncation in the middle of the read."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from pathlib import Path

import blake3

from helpers import POLL_TIMEOUT
from taskpoint.digests import pieces_of_file
from taskpoint.format.fileset import PIECE_SIZE

#: Four pieces of random bytes.
DATA = random.Random(7).randbytes(4 * PIECE_SIZE)


def test_a_file_truncated_by_another_process_while_read_gives_the_digest_of_what_was_read(tmp_path: Path) -> None:
    """At the first read, another process truncates the file to one piece, and every reader waits for it to be
    done (each thread tells ``on_read`` of each read, under one lock). Piece 0 is then read whole; the other
    threads read at most one buffer each before the truncation, nothing after it. The caller lives, and the size and
    digest are of those bytes: fewer pieces than the file had, which the manager reports as damage
    (tests/test_piece_count_damage.py)."""
    path = tmp_path / "object"
    path.write_bytes(DATA)
    truncator = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; sys.stdin.readline(); os.truncate(sys.argv[1], int(sys.argv[2]))",
         str(path), str(PIECE_SIZE)], stdin=subprocess.PIPE, text=True)
    lock, truncated = threading.Lock(), threading.Event()

    def on_read(n: int) -> None:
        with lock:
            if not truncated.is_set():
                assert truncator.stdin is not None
                truncator.stdin.write("go\n")
                truncator.stdin.close()
                assert truncator.wait(POLL_TIMEOUT) == 0
                truncated.set()

    try:
        with open(path, "rb") as f:
            count, digest = pieces_of_file(f.fileno(), len(DATA), on_read)
    finally:
        truncator.kill()
        truncator.wait(POLL_TIMEOUT)
    assert truncated.is_set()
    assert path.stat().st_size == PIECE_SIZE
    assert PIECE_SIZE <= count < 2 * PIECE_SIZE
    assert len(digest) % 64 == 0 and len(digest) < 4 * 64
    assert digest[:64] == blake3.blake3(DATA[:PIECE_SIZE]).hexdigest()


def test_a_file_read_whole_gives_the_blake3_of_each_piece(tmp_path: Path) -> None:
    path = tmp_path / "object"
    path.write_bytes(DATA[:3 * PIECE_SIZE + 5])
    with open(path, "rb") as f:
        count, digest = pieces_of_file(f.fileno(), 3 * PIECE_SIZE + 5)
    assert count == 3 * PIECE_SIZE + 5
    assert digest == "".join(blake3.blake3(DATA[start:min(start + PIECE_SIZE, count)]).hexdigest()
                             for start in range(0, count, PIECE_SIZE))
