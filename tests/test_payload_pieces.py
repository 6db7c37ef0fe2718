"""Payload steps by BLAKE3 pieces (issue 42 item 3, manifest version 7): what the pieces record, and that one flipped
byte of the stored object is caught, with its piece and that piece's bytes named, by a full restore, by a partial
restore and a file opened through the archive's index (which read only some pieces), and by verify; a step of
version 6 (one BLAKE3) still restores and verifies. tests/e2e/test_payload_pieces_s3.py runs the ranged reads on S3.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import blake3
import pytest

from helpers import flip_byte_at
from taskpoint import CheckpointCorruptError, CheckpointManager, NewerFormatError
from taskpoint.digests import DIGESTS
from taskpoint.format.fileset import PIECE_SIZE
from taskpoint.format.pieces import PAYLOAD_PIECES

CORPUS = Path(__file__).resolve().parent / "corpus"
#: Three files of random bytes (gzip stores them as they are): their archive is about 30 MiB, two pieces.
FILE_SIZE = 10 << 20
#: A stored byte in piece 1, inside the members that hold file ``b`` (plain bytes 10-20 MiB); file ``a`` (plain
#: bytes 0-10 MiB) lies in members stored before 16 MiB, in piece 0.
FLIPPED = 18 << 20
#: What a damaged piece 1 is reported as (a pattern: the object ends inside it).
PIECE_1 = rf"piece 1 of payload-[0-9a-f]+ \(bytes {PIECE_SIZE}-3[0-9]{{7}}\)"


def tree(folder: Path) -> dict[str, bytes]:
    """Write the three files into ``folder``; their contents by name."""
    rng = random.Random(42)
    files = {name: rng.randbytes(FILE_SIZE) for name in ("a", "b", "c")}
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def manifest_of(steps: Path, step: int) -> dict[str, Any]:
    return dict(json.loads((steps / f"ckpt-{step}" / "taskpoint.json").read_bytes()))


def saved_tree(manager: CheckpointManager, tmp_path: Path) -> tuple[dict[str, bytes], Path]:
    """The three files saved as step 1 by ``manager``: their contents, and the step's payload object."""
    files = tree(tmp_path / "tree")
    manager.save(tmp_path / "tree", 1)
    return files, Path(manager.describe(1).uri) / manager.describe(1).payload


def test_a_payload_step_records_the_blake3_of_each_piece_of_its_object(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(2 * PIECE_SIZE + 5)
    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        manager.save(data, 1)
        manager.save(b"", 2)
        stored = (tmp_path / "steps" / "ckpt-1" / manager.describe(1).payload).read_bytes()
    doc = manifest_of(tmp_path / "steps", 1)
    assert (doc["version"], doc["piece_size"], doc["piece_hash"], doc["sha256"]) == (7, PIECE_SIZE, "blake3", None)
    assert doc["pieces"] == [blake3.blake3(stored[at:at + PIECE_SIZE]).hexdigest()
                             for at in range(0, len(stored), PIECE_SIZE)]
    assert len(doc["pieces"]) == 3 and "blake3" not in doc
    assert manifest_of(tmp_path / "steps", 2)["pieces"] == [blake3.blake3(b"").hexdigest()]


@pytest.mark.parametrize("sizes", [[0], [1], [PIECE_SIZE], [PIECE_SIZE - 1, 2], [3 << 20] * 11, [PIECE_SIZE + 1]])
def test_the_pieces_digest_of_a_stream_is_each_pieces_blake3_however_it_is_fed(sizes: list[int]) -> None:
    rng = random.Random(sum(sizes))
    chunks = [rng.randbytes(size) for size in sizes]
    whole = b"".join(chunks)
    hasher = DIGESTS[PAYLOAD_PIECES]()
    for i, chunk in enumerate(chunks):
        hasher.update(chunk if i % 2 else memoryview(bytearray(chunk)))  # reused buffers are copied
    expected = [blake3.blake3(whole[at:at + PIECE_SIZE]).hexdigest() for at in range(0, len(whole), PIECE_SIZE)]
    assert hasher.hexdigest() == "".join(expected or [blake3.blake3(b"").hexdigest()])


def test_a_flipped_byte_is_caught_by_a_full_restore_and_by_verify_naming_its_piece(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        files, payload = saved_tree(manager, tmp_path)
        assert manager.verify(1).steps[0].detail == "blake3 pieces match its manifest"
        flip_byte_at(payload, FLIPPED)
        with pytest.raises(CheckpointCorruptError, match=f"is damaged: {PIECE_1} does not match the blake3 .*: "):
            manager.restore(1, tmp_path / "restored")
        assert not (tmp_path / "restored").exists() or not any((tmp_path / "restored").iterdir())
        (result,) = manager.verify().steps
        assert result.state == "damaged" and re.search(PIECE_1, result.detail), result.detail
        flip_byte_at(payload, FLIPPED)  # mended: every byte as saved
        assert {p.name: p.read_bytes() for p in manager.restore(1, tmp_path / "again").iterdir()} == files


def test_a_partial_restore_checks_the_pieces_it_reads(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        files, payload = saved_tree(manager, tmp_path)
        assert payload.stat().st_size > 2 * PIECE_SIZE - FILE_SIZE // 2  # it reaches into piece 1 far enough
        flip_byte_at(payload, FLIPPED)
        with pytest.raises(CheckpointCorruptError, match=f"{PIECE_1} does not match the blake3") as caught:
            manager.restore(1, tmp_path / "b", paths=["b"])
        assert not isinstance(caught.value, NewerFormatError)
        with pytest.raises(CheckpointCorruptError, match=f"{PIECE_1} does not match the blake3"), \
                manager.open(1, "b") as opened:
            opened.read()
        # File a lies in piece 0 only: restored whole, every byte checked.
        assert (manager.restore(1, tmp_path / "a", paths=["a"]) / "a").read_bytes() == files["a"]
        with manager.open(1, "a") as opened:
            assert opened.read() == files["a"]


def test_a_version_6_payload_step_restores_and_verifies_by_its_one_blake3(tmp_path: Path) -> None:
    """The corpus's payload steps of d153bc6 (manifest version 6): read, verified and damaged as they were."""
    steps = Path(shutil.copytree(CORPUS / "d153bc6" / "step_payload" / "steps", tmp_path / "steps"))
    doc = manifest_of(steps, 1)
    payload = steps / "ckpt-1" / doc["content"]["payload"]
    assert doc["version"] == 6 and doc["blake3"] == blake3.blake3(payload.read_bytes()).hexdigest()
    with CheckpointManager(steps, preemption=False) as manager:
        assert manager.verify(1).steps[0].detail == "blake3 matches its manifest"
        part = manager.restore(2, tmp_path / "part", paths=["sub/b.bin"])  # its index: checked by CRC32 alone
        assert (part / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 3
        flip_byte_at(payload, payload.stat().st_size // 2)
        with pytest.raises(CheckpointCorruptError, match="does not match the blake3 recorded"):
            manager.restore(1)


@pytest.mark.parametrize(("edit", "value"), [("pieces", ["0" * 64] * 2), ("piece_size", 1 << 20),
                                             ("piece_hash", "sha256")])
def test_pieces_that_do_not_fit_the_object_are_damage(tmp_path: Path, edit: str, value: object) -> None:
    from taskpoint.format.sealing import SHA256, check_of

    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        manager.save(b"some bytes", 1)
    path = tmp_path / "steps" / "ckpt-1" / "taskpoint.json"
    doc = json.loads(path.read_bytes())
    doc[edit] = value
    doc["check"] = check_of(doc, SHA256)
    path.write_text(json.dumps(doc, sort_keys=True))
    with CheckpointManager(tmp_path / "steps", preemption=False) as manager, \
            pytest.raises(CheckpointCorruptError) as caught:
        manager.restore(1)
    assert not isinstance(caught.value, NewerFormatError)


def test_a_shard_by_pieces_is_recorded_as_shard_version_3_and_commits_a_version_7_step() -> None:
    """A rank's part promoted from its local tier is a payload step there, recorded by pieces: its shard record
    and the sharded manifest carry the pieces, in versions older readers refuse as newer, never misread."""
    from taskpoint.format.records import ObjectRecord, Shard, ShardRecord, StepManifest
    from taskpoint.manager.kinds import KINDS
    from taskpoint.manager.kinds.sharded import Shards

    data = random.Random(3).randbytes(PIECE_SIZE + 1)
    hasher = DIGESTS[PAYLOAD_PIECES]()
    hasher.update(data)
    record = ObjectRecord(kind="bytes", codec="raw", save_id="1" * 32, created=1.0).with_digest(
        len(data), PAYLOAD_PIECES, hasher.hexdigest())
    shard = Shard(1, "payload-" + "1" * 32, record)
    stored = ShardRecord(4, 2, "round", shard).to_bytes()
    assert json.loads(stored)["version"] == 3
    assert ShardRecord.from_bytes(stored, "rank-1.json").shard.record.pieces == record.pieces
    manifest = StepManifest(4, ObjectRecord(kind="shards", codec="shards", save_id="2" * 32, created=1.0), None, {},
                            Shards((dataclasses.replace(shard, rank=0), shard)))
    doc = json.loads(manifest.to_bytes())
    assert doc["version"] == 7 and doc["content"]["shards"][1]["pieces"] == list(record.pieces)
    read = StepManifest.from_bytes(manifest.to_bytes(), "u", lambda kind: KINDS.kind(kind, "u").decode)
    assert read.content == manifest.content


def test_a_local_copy_is_told_from_the_committed_step_by_its_pieces(tmp_path: Path) -> None:
    described = []
    for name, data in (("one", b"x" * 100), ("same", b"x" * 100), ("other", b"y" * 100)):
        with CheckpointManager(tmp_path / name, preemption=False) as manager:
            manager.save(data, 1)
            described.append(manager.describe(1))
    one, same, other = described
    assert one.pieces and same.not_a_copy_of(one) is None
    assert "its BLAKE3 of 1 pieces is not the one" in str(other.not_a_copy_of(one))
