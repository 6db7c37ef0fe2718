"""What a deduplicated (``chunked``) step holds: a tree of files, folders and symlinks, each file as the chunks that
hold its bytes (:mod:`taskpoint.manager.chunks`), recorded in its step's manifest (:mod:`.records`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TreeEntry:
    """One entry of a deduplicated step: a file (its chunks, in order), a folder, or a symlink.

    ``path`` is relative, ``/``-separated; ``mode`` holds the permission bits (None: the default, for bytes);
    ``chunks`` are chunk keys ``<sha256 of the plain bytes>.<codec>``, each :attr:`ChunkedTree.chunk_size`
    bytes of the file but the last.
    """

    path: str
    type: str  # "file", "dir" or "link"
    mode: int | None = None
    size: int = 0
    mtime: float | None = None
    chunks: tuple[str, ...] = ()
    target: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "type": self.type}
        if self.mode is not None:
            doc["mode"] = self.mode
        if self.mtime is not None:
            doc["mtime"] = self.mtime
        if self.type == "file":
            doc["size"], doc["chunks"] = self.size, list(self.chunks)
        if self.type == "link":
            doc["target"] = self.target
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TreeEntry:
        kind, mode, mtime, target = str(doc["type"]), doc.get("mode"), doc.get("mtime"), doc.get("target")
        if kind not in ("file", "dir", "link") or (kind == "link") != isinstance(target, str):
            raise ValueError(f"a tree entry of type {kind!r} is malformed")
        chunks = tuple(str(c) for c in doc.get("chunks", ()))
        return cls(path=str(doc["path"]), type=kind, mode=None if mode is None else int(mode),
                   size=int(doc.get("size", 0)), mtime=None if mtime is None else float(mtime), chunks=chunks,
                   target=target)


@dataclass(frozen=True)
class ChunkedTree:
    """What a deduplicated step holds: its entries, parents before children, and the chunk size used."""

    chunk_size: int
    entries: tuple[TreeEntry, ...]

    def chunk_keys(self) -> set[str]:
        return {key for entry in self.entries for key in entry.chunks}

    def chunk_count(self) -> int:
        """How many chunks the files name, a chunk named twice counted twice."""
        return sum(len(entry.chunks) for entry in self.entries)

    def count(self, kind: str) -> int:
        """How many entries are of ``kind`` (``file``, ``dir`` or ``link``)."""
        return sum(entry.type == kind for entry in self.entries)

    def file_bytes(self) -> int:
        """The plain bytes of every file: what a restore writes."""
        return sum(entry.size for entry in self.entries if entry.type == "file")
