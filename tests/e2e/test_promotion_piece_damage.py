"""A local tier's step whose payload was damaged before its promotion is refused with the one damage sentence of a
piece (:func:`taskpoint.format.pieces.piece_damage`): the piece that differs and its bytes, or, for an object cut
short by a piece or more, the count of pieces read against the manifest's; on local disk and memory:// as the
remote tier."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import _location_fixture
from taskpoint import CheckpointCorruptError, CheckpointManager
from taskpoint.format.fileset import PIECE_SIZE

#: Saved by the local tier: two pieces once stored (random bytes, which gzip cannot shrink).
DATA = random.Random(7).randbytes(PIECE_SIZE + (1 << 20))


@pytest.fixture(params=["local", "memory"])
def remote(request: pytest.FixtureRequest) -> Iterator[object]:
    yield from _location_fixture(request)


@pytest.mark.parametrize("change", ["flipped", "truncated"])
def test_a_damaged_local_payload_is_not_promoted_and_the_error_names_its_piece(remote, tmp_path: Path,
                                                                                change: str) -> None:
    local_dir = tmp_path / "local"
    with CheckpointManager(local_dir, preemption=False) as before:  # a run killed before the step's promotion
        before.save(DATA, 3)
    (payload,) = (local_dir / "ckpt-3").glob("payload-*")
    stored = bytearray(payload.read_bytes())
    if change == "flipped":
        stored[PIECE_SIZE + 100] ^= 0x40
        said = rf"step 3 in .* is damaged: piece 1 of {payload.name} \(bytes {PIECE_SIZE}-{len(stored) - 1}\) does "
    else:
        del stored[PIECE_SIZE // 2:]
        said = (rf"step 3 in .* is damaged: read 1 piece of {payload.name} \({PIECE_SIZE // 2} bytes\), the manifest "
                rf"records 2 \({payload.stat().st_size} bytes\)")
    payload.write_bytes(bytes(stored))
    with CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, local_dir=local_dir,
                           remote_every=3, preemption=False) as manager:
        manager.save(b"step 6", 6)
        with pytest.raises(CheckpointCorruptError, match=rf"{said}.*; it was not promoted to "):
            manager.wait_until_finished()
        assert 3 not in manager.steps(tier="remote")
