"""Stored documents as a newer taskpoint would write them: the version edited to one no taskpoint writes yet, and
sealed again, so that only the version tells them from today's (tests of the "newer: upgrade" state)."""

from __future__ import annotations

import json
from pathlib import Path

import taskpoint
from taskpoint.format.records import RECORD_SUFFIX
from taskpoint.format.sealing import CHECK, CRC32, SHA256, check_of

#: A version no taskpoint writes yet.
FUTURE = 99


def from_the_future(document: Path) -> None:
    """Rewrite the sealed ``document`` (a record or a manifest) with version :data:`FUTURE`, sealed again."""
    doc = json.loads(document.read_bytes())
    doc["version"] = FUTURE
    doc[CHECK] = check_of(doc, CRC32 if document.name.endswith(RECORD_SUFFIX) else SHA256)
    document.write_bytes(json.dumps(doc, sort_keys=True).encode())


def steps_with_a_newer_one(root: Path) -> Path:
    """A manager directory of three steps: 1 healthy, 2 written by a newer taskpoint (its manifest), 3 healthy."""
    with taskpoint.CheckpointManager(str(root), keep=None, preemption=False) as manager:
        for step in (1, 2, 3):
            manager.save(bytes([step]) * 1000, step)
    from_the_future(root / "ckpt-2" / "taskpoint.json")
    return root


def damage(root: Path, step: int) -> None:
    """Flip a byte of the payload of ``step`` in the directory ``root``."""
    (payload,) = [p for p in (root / f"ckpt-{step}").iterdir() if p.name != "taskpoint.json"]
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 1
    payload.write_bytes(bytes(data))
