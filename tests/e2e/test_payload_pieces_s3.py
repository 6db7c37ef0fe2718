"""BLAKE3 pieces on S3 (issue 42 item 3): a partial restore and a file opened through the archive's index read whole
pieces with ranged GETs, and check each before its bytes are used. One flipped byte of the stored object, written
back to the store, is caught with its piece named; the members in other pieces still restore, every byte as saved.
Through s3fs, on the S3 server (tests/test_payload_pieces.py runs the same on local disk)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from helpers import read_object, write_object
from taskpoint import CheckpointCorruptError, CheckpointManager
from test_payload_pieces import FLIPPED, PIECE_1, tree


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_ranged_reads_check_the_pieces_they_read(store: Any, tmp_path: Path) -> None:
    files = tree(tmp_path / "tree")
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options, preemption=False) as manager:
        manager.save(tmp_path / "tree", 1)
        assert (manager.restore(1, tmp_path / "whole", paths=["c"]) / "c").read_bytes() == files["c"]
        url = store.url("steps", "ckpt-1", manager.describe(1).payload)
        stored = bytearray(read_object(url, store.storage_options))
        stored[FLIPPED] ^= 0x01
        write_object(url, store.storage_options, bytes(stored))
        with pytest.raises(CheckpointCorruptError, match=f"{PIECE_1} does not match the blake3"):
            manager.restore(1, tmp_path / "b", paths=["b"])
        with pytest.raises(CheckpointCorruptError, match=f"{PIECE_1} does not match the blake3"), \
                manager.open(1, "b") as opened:
            opened.read()
        assert (manager.restore(1, tmp_path / "a", paths=["a"]) / "a").read_bytes() == files["a"]
        (result,) = manager.verify().steps
        assert result.state == "damaged" and re.search(PIECE_1, result.detail), result.detail
