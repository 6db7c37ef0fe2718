"""The manifest of a file set: a folder of files saved together, each listed with its size and sha256.

A file set is committed by a file its writer's format names (``taskpoint.torch`` names PyTorch DCP's), written
after this manifest, which lists that commit file too: every byte a load reads is checked against
it. The manifest guards itself with ``check``, the sha256 of the rest of the document (as every manifest does,
:func:`~taskpoint.format.records.sealed`), so a flipped byte in the manifest reads as damage, never as a file
that seems damaged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError
from .sealing import parse, sealed

FILESET_FORMAT = "taskpoint.fileset"
#: Newest version of the file-set manifest this taskpoint reads and the one it writes.
FILESET_VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    """One stored file of a set: its size in bytes and the sha256 (hex) of its bytes."""

    size: int
    sha256: str


@dataclass(frozen=True)
class FileSetManifest:
    """Every file of a saved set by name (relative, ``/``-separated), what wrote it, and who saved it.

    ``kind`` names the writer's format (``"torch.dcp"``); ``attempt`` and ``metadata`` are what a
    :class:`~taskpoint.CheckpointManager` step records (the task attempt, the user's JSON metadata).
    """

    kind: str
    save_id: str
    created: float
    files: dict[str, FileEntry]
    attempt: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": FILESET_FORMAT, "version": FILESET_VERSION, "kind": self.kind, "save_id": self.save_id,
            "created": self.created, "attempt": self.attempt, "metadata": self.metadata,
            "files": {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())},
        }
        return sealed(doc)

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> FileSetManifest:
        def build(doc: dict[str, Any], checked: bool) -> FileSetManifest:
            if not checked:
                raise ValueError("the manifest carries no check (a damaged byte)")
            files = {str(name): FileEntry(size=int(e["size"]), sha256=str(e["sha256"]))
                     for name, e in doc["files"].items()}
            attempt, metadata = doc.get("attempt"), doc.get("metadata", {})
            if not isinstance(metadata, dict):
                raise TypeError("metadata is not a JSON object")
            return cls(kind=str(doc["kind"]), save_id=str(doc["save_id"]), created=float(doc["created"]),
                       files=files, attempt=None if attempt is None else int(attempt), metadata=metadata)

        return parse(data, FILESET_FORMAT, uri, build, FILESET_VERSION,
                      "the checkpoint cannot be verified; save it again")

    def entry(self, name: str, where: str) -> FileEntry:
        """The entry of ``name``; CheckpointCorruptError when the manifest does not list it."""
        found = self.files.get(name)
        if found is None:
            raise CheckpointCorruptError(f"{where}/{name} is not listed in the checkpoint's manifest, so it cannot "
                                         "be verified: the checkpoint was changed after its save; save it again")
        return found
