"""Verify of a local payload of :data:`~taskpoint.storage.localio.MAPPED_FROM` bytes or more hashes it from a
memory map in a child process (:func:`~taskpoint.storage.localio.hash_mapped`): a file truncated by another
process under the map ends the child by SIGBUS and never the verifier, which reads the pieces the child did not
hash; the result is the file's damage, or success where the child was done first. Real processes, real
truncations, real SIGBUS."""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from helpers import POLL_TIMEOUT
from taskpoint import CheckpointManager
from taskpoint.digests import pieces_of_file
from taskpoint.format.fileset import PIECE_SIZE
from taskpoint.storage import localio
from taskpoint.storage.localio import MAPPED_FROM, hash_mapped

WATCHER = Path(__file__).resolve().parents[1] / "_map_watcher.py"
#: Just over the size from which verify maps: 18 pieces of random bytes (gzip cannot shrink them under it).
SIZE = MAPPED_FROM + 2 * PIECE_SIZE


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of steps whose step 1 is a payload of :data:`SIZE` random bytes (saved once: 10 s on a busy
    machine)."""
    folder = tmp_path_factory.mktemp("saved") / "steps"
    rng = random.Random(42)
    with CheckpointManager(str(folder), preemption=False) as manager:
        manager.save(b"".join(rng.randbytes(PIECE_SIZE) for _ in range(SIZE // PIECE_SIZE)), 1)
    return folder


@pytest.fixture
def step(saved: Path, tmp_path: Path) -> tuple[CheckpointManager, Path]:
    """A manager of a copy of :func:`saved`, and the path of its step's payload object (each test may damage it)."""
    shutil.copytree(saved, tmp_path / "steps")
    (payload,) = (tmp_path / "steps" / "ckpt-1").glob("payload-*")
    assert payload.stat().st_size >= MAPPED_FROM
    return CheckpointManager(str(tmp_path / "steps"), preemption=False), payload


def test_a_file_truncated_under_the_map_ends_the_child_by_sigbus_and_the_caller_lives(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Pieces of 4 KiB: the child gets at most a pipe's worth of lines ahead of a caller that does not read them,
    so it is still hashing when the caller, at the first piece, has another process truncate the file to 1 MiB and
    waits for it to be done. The child then touches a page past the end: SIGBUS, its end alone. Each piece it
    reported is the piece's BLAKE3; the rest are missing, for the caller to read."""
    data = random.Random(7).randbytes(64 << 20)
    path = tmp_path / "object"
    path.write_bytes(data)
    piece = 4096
    truncator = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; sys.stdin.readline(); os.truncate(sys.argv[1], 1 << 20)", str(path)],
        stdin=subprocess.PIPE, text=True)
    got: dict[int, str] = {}

    def on_piece(index: int, digest: str) -> None:
        if not got:
            assert truncator.stdin is not None
            truncator.stdin.write("go\n")
            truncator.stdin.close()
            assert truncator.wait(POLL_TIMEOUT) == 0
        got[index] = digest

    with open(path, "rb") as f, caplog.at_level(logging.WARNING, logger="taskpoint"):
        hash_mapped(f.fileno(), len(data), piece, "blake3", 2, on_piece)
    assert path.stat().st_size == 1 << 20
    assert "ended by signal Bus error" in caplog.text, caplog.text
    assert 0 < len(got) < len(data) // piece
    assert all(digest == blake3.blake3(data[index * piece:(index + 1) * piece]).hexdigest()
               for index, digest in got.items())


def test_a_child_that_reports_nothing_for_the_stall_bound_is_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every wait has its bound: a child stopped (SIGSTOP, by another process, at the caller's first piece, while it
    waits on its full pipe) reports nothing more; after :data:`~taskpoint.storage.localio.MAPPED_STALL` seconds (1
    here) the caller ends it, says so, and returns with the pieces it had."""
    monkeypatch.setattr(localio, "MAPPED_STALL", 1.0)
    path = tmp_path / "object"
    path.write_bytes(bytes(16 << 20))
    got: dict[int, str] = {}

    def on_piece(index: int, digest: str) -> None:
        if not got:
            stopper = subprocess.run([sys.executable, str(WATCHER), str(os.getpid()), str(path), "stop"],
                                     capture_output=True, text=True, timeout=POLL_TIMEOUT)
            assert stopper.stdout == "stopped\n", stopper
        got[index] = digest

    with open(path, "rb") as f, caplog.at_level(logging.WARNING, logger="taskpoint"):
        hash_mapped(f.fileno(), 16 << 20, 4096, "blake3", 2, on_piece)
    assert "reported no piece for 1.0 s: ending it" in caplog.text, caplog.text
    assert "ended by signal Killed" in caplog.text, caplog.text
    assert 0 < len(got) < (16 << 20) // 4096


def test_a_step_truncated_by_another_process_while_verified_is_damage_or_healthy(
        step: tuple[CheckpointManager, Path], caplog: pytest.LogCaptureFixture) -> None:
    """Another process truncates the payload to one piece as soon as the verifier's child has it mapped
    (:mod:`_map_watcher`): the verifier lives, and says the step is damaged, by the pieces it found; or healthy, where
    the child hashed every piece first (here 24 rounds of 27 at load 17-22 were damage, by SIGBUS)."""
    manager, payload = step
    stored = payload.stat().st_size
    truncator = subprocess.Popen(
        [sys.executable, str(WATCHER), str(os.getpid()), str(payload), f"truncate:{PIECE_SIZE}"],
        stdout=subprocess.PIPE, text=True)
    with manager, caplog.at_level(logging.WARNING, logger="taskpoint"):
        (result,) = manager.verify().steps
    truncator.kill()  # done, or still looking: the child may be done before a busy machine's scan of /proc saw it
    truncator.communicate(timeout=POLL_TIMEOUT)
    if result.healthy:  # the child hashed every piece before the truncation, or there was none
        return
    assert payload.stat().st_size == PIECE_SIZE
    assert result.state == "damaged"
    # The pieces the child hashed before the truncation, and what the reads found after it.
    said = re.search(rf"read (\d+) pieces? of {payload.name} \((\d+) bytes\), the manifest records "
                     rf"{-(-stored // PIECE_SIZE)} \({stored} bytes\)", result.detail)
    assert said is not None, result.detail
    assert 1 <= int(said[1]) < -(-stored // PIECE_SIZE) and PIECE_SIZE <= int(said[2]) < stored
    assert "the mapped hash of a local file ended by" in caplog.text, caplog.text


def test_a_step_open_for_writing_elsewhere_verifies_from_the_map(
        step: tuple[CheckpointManager, Path], caplog: pytest.LogCaptureFixture) -> None:
    """A map needs no lease: another process holding the payload open for writing changes nothing, and the child
    hashes every piece (nothing is logged)."""
    manager, payload = step
    writer = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); sys.stdin.read()",
                               str(payload)], stdin=subprocess.PIPE)
    try:
        with manager, caplog.at_level(logging.WARNING, logger="taskpoint"):
            (result,) = manager.verify().steps
    finally:
        writer.communicate(timeout=POLL_TIMEOUT)
    assert result.healthy, result.detail
    assert "mapped hash" not in caplog.text, caplog.text


def test_damage_found_from_the_map_names_its_piece(step: tuple[CheckpointManager, Path]) -> None:
    manager, payload = step
    with open(payload, "r+b") as f:
        f.seek(5 * PIECE_SIZE + 123)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with manager:
        (result,) = manager.verify().steps
    assert result.state == "damaged"
    assert f"piece 5 of {payload.name} (bytes {5 * PIECE_SIZE}-" in result.detail, result.detail


def test_where_no_child_can_start_the_pieces_are_read(
        step: tuple[CheckpointManager, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """An interpreter that is not there (an embedded Python whose ``sys.executable`` is no program): the same
    digest, by reads, and a warning."""
    _, payload = step
    with open(payload, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = pieces_of_file(f.fileno(), size)
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
        with caplog.at_level(logging.WARNING, logger="taskpoint"):
            read = pieces_of_file(f.fileno(), size)
    assert read == mapped
    assert mapped[0] == size
    assert "could not start the mapped hash" in caplog.text, caplog.text
