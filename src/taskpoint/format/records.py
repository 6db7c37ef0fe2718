"""The small record kept beside each checkpoint object: what kind it is and its checksum.

The checkpoint object itself stays in Flyte's format (raw bytes, or a tar.gz), so other tools can read it.
The record lives in a second object, ``<destination>.taskpoint.json``. A save writes the record twice:
before the object, naming the save as *pending* (kind, codec and, when known, size), and after it, naming
it *committed* with its size and CRC32. A crash between the object and the final record leaves a
pending entry that still tells load the kind; a good checkpoint therefore never becomes unloadable, and
outside that window every byte is verified against the recorded CRC32 and size. The record guards itself
too: each entry carries a ``check``, the CRC32 of the fields that the object's digest does not cover (kind,
codec, save id, time), and a record with a field it does not know, or a version below 1, is refused as
damaged; so any flipped byte of a record is detected (records written before the check load as before).

The versioned manager (:mod:`taskpoint.manager`) keeps a :class:`StepManifest` in each step's folder instead: it is
written once, after the payload, and is the step's commit.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from ..errors import CheckpointCorruptError

MANIFEST_SUFFIX = ".taskpoint.json"
FORMAT = "taskpoint.checkpoint"
FORMAT_VERSION = 1
#: The format name of a manager step's manifest; it shares :data:`FORMAT_VERSION`.
STEP_FORMAT = "taskpoint.step"

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectRecord:
    """One saved object: the payload kind, the archive codec ("raw" for bytes and files) and its digest."""

    kind: str
    codec: str
    save_id: str
    created: float
    size: int | None = None
    sha256: str | None = None
    #: CRC32 of the stored bytes (hex); single checkpoints record this instead of a sha256.
    crc32: str | None = None


@dataclass(frozen=True)
class Manifest:
    committed: ObjectRecord | None = None
    pending: ObjectRecord | None = None
    #: A save failed after it started writing: the next save sweeps what it may have left (S3 parts).
    interrupted: bool = False

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION,
                               "committed": _sealed(self.committed), "pending": _sealed(self.pending)}
        if self.interrupted:
            doc["interrupted"] = True
        return json.dumps(doc, sort_keys=True).encode()

    @property
    def needs_sweep(self) -> bool:
        """True when a save was killed or failed here since the last good one."""
        return self.pending is not None or self.interrupted

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> Manifest:
        def build(doc: dict[str, Any]) -> Manifest:
            unknown = set(doc) - _MANIFEST_KEYS
            if unknown or int(doc["version"]) < 1:
                raise ValueError(f"unknown fields {sorted(unknown)} or version {doc['version']!r}")
            return cls(committed=_record(doc.get("committed"), sealed=True),
                       pending=_record(doc.get("pending"), sealed=True),
                       interrupted=bool(doc.get("interrupted", False)))

        return _parse(data, FORMAT, uri, build,
                      "delete it to load the checkpoint without verification, or save a new checkpoint")


@dataclass(frozen=True)
class StepManifest:
    """The commit of one manager step: which payload object holds it, its digest, and the user's metadata."""

    step: int
    #: Name of the payload object inside the step's folder (unique per save: ``payload-<save_id>``).
    payload: str
    record: ObjectRecord
    #: The task attempt that saved it (from ``taskpoint.ctx()``), None outside a task.
    attempt: int | None
    metadata: dict[str, Any]

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {"format": STEP_FORMAT, "version": FORMAT_VERSION, "step": self.step,
                               "payload": self.payload, **asdict(self.record), "attempt": self.attempt,
                               "metadata": self.metadata}
        return json.dumps(doc, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> StepManifest:
        def build(doc: dict[str, Any]) -> StepManifest:
            attempt, metadata, record = doc.get("attempt"), doc["metadata"], _record(doc)
            if not isinstance(metadata, dict) or record is None:
                raise TypeError("metadata is not a JSON object")
            return cls(step=int(doc["step"]), payload=str(doc["payload"]), record=record,
                       attempt=None if attempt is None else int(attempt), metadata=metadata)

        return _parse(data, STEP_FORMAT, uri, build, "delete the step, or save it again with overwrite=True")


def _parse(data: bytes, fmt: str, uri: str, build: Callable[[dict[str, Any]], T], what_to_do: str) -> T:
    """``build`` applied to the ``fmt`` document in ``data``; anything unreadable is CheckpointCorruptError."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != fmt:
            raise ValueError("not a taskpoint manifest")
        if int(doc.get("version", 0)) > FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"the checkpoint record {uri} has format version {doc['version']}, newer than this "
                f"taskpoint understands ({FORMAT_VERSION}); upgrade taskpoint to load it.")
        return build(doc)
    except CheckpointCorruptError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointCorruptError(f"the checkpoint record {uri} is unreadable ({exc}); {what_to_do}.") from exc


#: The fields of a checkpoint's record; any other is damage (a format change bumps FORMAT_VERSION).
_MANIFEST_KEYS = frozenset({"format", "version", "committed", "pending", "interrupted"})
#: The fields of an entry; ``check`` is the CRC32 of those in _CHECKED.
_ENTRY_KEYS = frozenset({f.name for f in fields(ObjectRecord)} | {"check"})
#: The fields of an entry that the stored object's size and digest do not vouch for.
_CHECKED = ("kind", "codec", "save_id", "created")


def _check(value: dict[str, Any]) -> str:
    return f"{zlib.crc32(json.dumps([value.get(k) for k in _CHECKED]).encode()):08x}"


def _sealed(record: ObjectRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    value = asdict(record)
    return {**value, "check": _check(value)}


def _record(value: Any, *, sealed: bool = False) -> ObjectRecord | None:
    """The entry ``value``; with ``sealed``, unknown fields or a ``check`` that does not match are damage."""
    if value is None:
        return None
    if sealed:
        unknown = set(value) - _ENTRY_KEYS
        if unknown or ("check" in value and value["check"] != _check(value)):
            raise ValueError(f"an entry fails its check (fields {sorted(value)})")
    return ObjectRecord(kind=str(value["kind"]), codec=str(value["codec"]), save_id=str(value["save_id"]),
                        created=float(value["created"]), size=value.get("size"), sha256=value.get("sha256"),
                        crc32=value.get("crc32"))
