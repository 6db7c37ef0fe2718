"""``Checkpoint(..., copy_of=)``: a source copied without its record (Flyte's local retries copy only the
checkpoint object) is verified against the record beside the object it was copied from."""

from __future__ import annotations

import logging
import shutil

import pytest

from taskpoint import Checkpoint, CheckpointCorruptError


def _saved_and_copied(tmp_path, data: bytes = b"state at step 300"):
    Checkpoint(tmp_path / "checkpoint").save_sync(data)
    shutil.copy2(tmp_path / "checkpoint", tmp_path / "prev_checkpoint")  # what Flyte's local retry does
    return tmp_path / "checkpoint", tmp_path / "prev_checkpoint"


def test_a_copy_loads_verified_against_the_record_of_its_original(tmp_path, caplog):
    dest, prev = _saved_and_copied(tmp_path)
    with caplog.at_level(logging.WARNING, logger="taskpoint"), \
            Checkpoint(dest, prev, copy_of=dest, verify="strict") as cp:
        assert cp.load_sync().read_bytes() == b"state at step 300"
    assert not caplog.records


def test_a_damaged_copy_is_not_taken_for_a_verified_one(tmp_path, caplog):
    dest, prev = _saved_and_copied(tmp_path)
    prev.write_bytes(prev.read_bytes()[:-1] + b"X")  # the same size, one byte changed
    with caplog.at_level(logging.WARNING, logger="taskpoint"), Checkpoint(dest, prev, copy_of=dest) as cp:
        assert cp.load_sync().read_bytes() == b"state at step 30X"  # as any object without a record: unverified
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"It is a copy of {dest}, and no record there lists it either" in warning
    with Checkpoint(dest, prev, copy_of=dest, verify="strict") as cp, pytest.raises(CheckpointCorruptError):
        cp.load_sync()


def test_a_copy_of_an_object_without_a_record_loads_unverified(tmp_path, caplog):
    (tmp_path / "checkpoint").write_bytes(b"written by flyte")
    shutil.copy2(tmp_path / "checkpoint", tmp_path / "prev_checkpoint")
    with caplog.at_level(logging.WARNING, logger="taskpoint"), \
            Checkpoint(tmp_path / "checkpoint", tmp_path / "prev_checkpoint", copy_of=tmp_path / "checkpoint") as cp:
        assert cp.load_sync().read_bytes() == b"written by flyte"
    assert len(caplog.records) == 1 and "loaded unverified" in caplog.records[0].getMessage()


def test_the_record_of_the_source_itself_wins(tmp_path):
    Checkpoint(tmp_path / "prev").save_sync(b"own record")
    Checkpoint(tmp_path / "other").save_sync(b"other record")
    with Checkpoint(tmp_path / "next", tmp_path / "prev", copy_of=tmp_path / "other", verify="strict") as cp:
        assert cp.load_sync().read_bytes() == b"own record"
