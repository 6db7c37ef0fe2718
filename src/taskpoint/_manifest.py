"""The small record kept beside each checkpoint object: what kind it is and its checksum.

The checkpoint object itself stays in Flyte's format (raw bytes, or a tar.gz), so other tools can read it.
The record lives in a second object, ``<destination>.taskpoint.json``. A save writes the record twice:
before the object, naming the save as *pending* (kind, codec and, when known, size), and after it, naming
it *committed* with its size and sha256. A crash between the object and the final record leaves a
pending entry that still tells load the kind; a good checkpoint therefore never becomes unloadable, and
outside that window every byte is verified against the recorded sha256.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from .errors import CheckpointCorruptError

MANIFEST_SUFFIX = ".taskpoint.json"
FORMAT = "taskpoint.checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ObjectRecord:
    """One saved object: the payload kind, the archive codec ("raw" for bytes and files) and its digest."""

    kind: str
    codec: str
    save_id: str
    created: float
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class Manifest:
    committed: ObjectRecord | None = None
    pending: ObjectRecord | None = None

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION,
                               "committed": self.committed and asdict(self.committed),
                               "pending": self.pending and asdict(self.pending)}
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> Manifest:
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ValueError("not a taskpoint manifest")
            if int(doc.get("version", 0)) > FORMAT_VERSION:
                raise CheckpointCorruptError(
                    f"the checkpoint record {uri} has format version {doc['version']}, newer than this "
                    f"taskpoint understands ({FORMAT_VERSION}); upgrade taskpoint to load it.")
            return cls(committed=_record(doc.get("committed")), pending=_record(doc.get("pending")))
        except CheckpointCorruptError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointCorruptError(
                f"the checkpoint record {uri} is unreadable ({exc}); delete it to load the checkpoint "
                "without verification, or save a new checkpoint.") from exc


def _record(value: Any) -> ObjectRecord | None:
    if value is None:
        return None
    return ObjectRecord(kind=str(value["kind"]), codec=str(value["codec"]), save_id=str(value["save_id"]),
                        created=float(value["created"]), size=value.get("size"), sha256=value.get("sha256"))
