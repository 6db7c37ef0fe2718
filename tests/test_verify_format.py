"""``taskpoint verify`` holds every document of a step to its specification (docs/format.md): a manifest whose
check matches but whose field breaks the specification (written by another writer, or a taskpoint with a bug) is
reported DAMAGED, naming the document and the field, with the exit code of damage. Local disk: the documents are
what is tested, not the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import taskpoint
from taskpoint.cli import main
from taskpoint.format.sealing import CRC32, SHA256, sealed

DAMAGED = 2


def _saved(tmp_path: Path) -> Path:
    directory = tmp_path / "steps"
    with taskpoint.CheckpointManager(str(directory), preemption=False) as manager:
        manager.save(b"state", 1)
    return directory


def _edit(manifest: Path, **fields: object) -> None:
    """Change fields of a sealed manifest and seal it again, as a writer that got them wrong would."""
    doc = json.loads(manifest.read_bytes())
    doc.pop("check")
    manifest.write_bytes(sealed({**doc, **fields}, SHA256))


@pytest.mark.parametrize(("field", "value", "said"), [
    ("size", "5", "field `size`: expected int or null, found str"),
    ("save_id", "abc", "field `save_id`: expected 32 lower-case hex digits"),
    ("crc32", "0badc0de", "field `crc32`: expected null, found str"),
])
def test_a_manifest_off_its_specification_is_reported_with_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object, said: str) -> None:
    directory = _saved(tmp_path)
    assert main(["verify", str(directory)]) == 0
    capsys.readouterr()
    _edit(directory / "ckpt-1" / "taskpoint.json", **{field: value})
    assert main(["verify", str(directory)]) == DAMAGED
    out = " ".join(capsys.readouterr().out.split())
    assert "step 1: DAMAGED" in out and "taskpoint.json does not follow the stored format" in out and said in out


def test_a_field_the_readers_tolerate_is_still_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``created`` as a numeric string reads (the reader takes float() of it) and the payload verifies: only the
    format check sees it."""
    directory = _saved(tmp_path)
    manifest = directory / "ckpt-1" / "taskpoint.json"
    _edit(manifest, created=str(json.loads(manifest.read_bytes())["created"]))
    with taskpoint.CheckpointManager(str(directory), preemption=False) as manager:
        assert manager.restore(1).read_bytes() == b"state"
    assert main(["verify", str(directory)]) == DAMAGED
    assert "field `created`: expected int or float, found str" in " ".join(capsys.readouterr().out.split())


def test_a_checkpoints_record_off_its_specification_is_reported(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The record beside a single checkpoint (CRC32-sealed) with an entry's ``sha256`` set, where the specification
    says null: the object still matches its CRC32, and verify reports the record's field."""
    destination = tmp_path / "ckpt"
    taskpoint.Checkpoint(str(destination)).save_sync(b"state")
    record = tmp_path / "ckpt.taskpoint.json"
    doc = json.loads(record.read_bytes())
    doc.pop("check")
    doc["objects"][0]["sha256"] = "0" * 64
    record.write_bytes(sealed(doc, CRC32))
    assert main(["verify", str(destination)]) == DAMAGED
    err = " ".join(capsys.readouterr().err.split())
    assert "does not follow the stored format" in err and "field `objects[0].sha256`: expected null" in err
