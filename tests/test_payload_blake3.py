"""Payload steps by BLAKE3 (issue 42 item 3): what a save records (BLAKE3 pieces, manifest version 7), what an older
reader makes of it, and the digest each older step keeps (one BLAKE3 in version 6, a sha256 in version 1). The
corpus (test_stored_corpus) reads and verifies the stored samples of every version; test_payload_pieces covers what
pieces catch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import pytest

from taskpoint import CheckpointCorruptError, CheckpointManager, NewerFormatError
from taskpoint.format.pieces import PAYLOAD_PIECES
from taskpoint.format.records import BLAKE3_VERSION, FORMAT_VERSION, PIECES_VERSION, STEP_FORMAT, StepManifest
from taskpoint.format.sealing import parse

CORPUS = Path(__file__).resolve().parent / "corpus"


def _manifest(root: Path, step: int) -> dict[str, object]:
    return json.loads((root / f"ckpt-{step}" / "taskpoint.json").read_bytes())


def test_a_payload_step_records_the_blake3_of_its_object_and_no_sha256(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        manager.save(b"some bytes", 1)
        described = manager.describe(1)
    doc = _manifest(tmp_path / "steps", 1)
    stored = (tmp_path / "steps" / "ckpt-1" / described.payload).read_bytes()
    assert (doc["version"], doc["step_kind"], doc["sha256"]) == (PIECES_VERSION, "payload", None)
    assert doc["pieces"] == [blake3.blake3(stored).hexdigest()] and "blake3" not in doc


@pytest.mark.parametrize("older", [BLAKE3_VERSION - 1, BLAKE3_VERSION])
def test_a_reader_of_an_older_version_refuses_a_version_7_manifest_as_newer_never_as_damaged(
        tmp_path: Path, older: int) -> None:
    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        manager.save(b"some bytes", 1)
    data = (tmp_path / "steps" / "ckpt-1" / "taskpoint.json").read_bytes()
    with pytest.raises(CheckpointCorruptError, match=f"format version 7, newer than this taskpoint understands "
                                                     f"\\({older}\\); upgrade taskpoint") as caught:
        parse(data, STEP_FORMAT, "ckpt-1/taskpoint.json", lambda doc, checked: doc, older, "")
    assert isinstance(caught.value, NewerFormatError)
    assert FORMAT_VERSION == PIECES_VERSION


def test_a_step_saved_by_sha256_stays_verified_by_its_sha256(tmp_path: Path) -> None:
    """The corpus's payload step of 924660e (manifest version 1): its object's sha256, not a BLAKE3, is what a flipped
    byte fails."""
    import shutil

    root = Path(shutil.copytree(CORPUS / "924660e" / "step_payload" / "steps", tmp_path / "steps"))
    doc = _manifest(root, 1)
    payload = root / "ckpt-1" / str(doc["payload"])
    assert doc["version"] == 1 and doc["sha256"] == hashlib.sha256(payload.read_bytes()).hexdigest()
    with CheckpointManager(root, preemption=False) as manager:
        assert manager.verify(1).steps[0].detail == "sha256 matches its manifest"
        payload.write_bytes(payload.read_bytes()[:-1] + b"!")
        with pytest.raises(CheckpointCorruptError, match="does not match the sha256 recorded"):
            manager.restore(1)


def test_a_manifest_read_again_keeps_its_digest_and_version(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        manager.save(b"some bytes", 1)
    data = (tmp_path / "steps" / "ckpt-1" / "taskpoint.json").read_bytes()
    from taskpoint.manager.kinds import KINDS

    manifest = StepManifest.from_bytes(data, "u", lambda kind: KINDS.kind(kind, "u").decode)
    assert manifest.record.hash_name == PAYLOAD_PIECES and manifest.to_bytes() == data
