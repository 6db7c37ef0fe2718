"""A payload object of whole pieces (exactly 16 MiB, or a multiple) is recorded and read back by one BLAKE3 per piece,
however its stream ends. A read of a remote object ends with an empty read (``shutil.copyfileobj``, then
``HashingReader.drain``), which once began an empty last piece: a step of exactly one piece, promoted to S3, then
read back as two pieces and was refused as damaged (CI on main, tests/e2e/test_local_tier_preempt.py). On memory://,
whose reads go through the same streaming path as S3's (local disk hashes by positional reads instead)."""

from __future__ import annotations

import random
import uuid
from typing import Any

import blake3
import pytest

from taskpoint import CheckpointManager
from taskpoint.digests import PayloadPieces
from taskpoint.format.fileset import PIECE_SIZE
from taskpoint.format.pieces import split_pieces


def pieces_of(data: bytes) -> str:
    """The pieces digest of ``data`` computed here, one BLAKE3 per piece (one of no bytes for none)."""
    spans = range(0, len(data), PIECE_SIZE) or range(1)
    return "".join(blake3.blake3(data[at:at + PIECE_SIZE]).hexdigest() for at in spans)


@pytest.mark.parametrize("pieces", [0, 1, 2])
@pytest.mark.parametrize("empty", [b"", bytearray(), memoryview(b"")], ids=["bytes", "bytearray", "memoryview"])
def test_an_empty_read_at_a_piece_boundary_begins_no_piece(pieces: int, empty: Any) -> None:
    data = random.Random(pieces).randbytes(pieces * PIECE_SIZE)
    digests = PayloadPieces()
    for at in range(0, len(data), PIECE_SIZE // 2):
        digests.update(empty)  # an empty read anywhere: before the first byte, and between pieces
        digests.update(data[at:at + PIECE_SIZE // 2])
    digests.update(empty)  # the end of the stream
    assert digests.hexdigest() == pieces_of(data)


@pytest.mark.parametrize("size", [PIECE_SIZE, 2 * PIECE_SIZE])
def test_a_step_of_whole_pieces_restores_and_verifies_from_a_streamed_store(size: int) -> None:
    data = random.Random(size).randbytes(size)
    with CheckpointManager(f"memory://tp-{uuid.uuid4().hex}", preemption=False) as manager:
        manager.save(data, 1)
        assert manager.describe(1).pieces == split_pieces(pieces_of(data))
        assert manager.restore(1).read_bytes() == data
        (result,) = manager.verify().steps
        assert result.state == "healthy", result.detail
