"""The index of an archive: where each tar member lies, and which independent compressed members hold it.

A directory archive is a tar stream compressed as a series of members that inflate on their own (gzip's 4 MiB
members, :mod:`.pgzip`). The index written with it lists each member's compressed and plain length, and each
tar entry's name, type, and where its header, its data and its end lie in the plain tar stream. A partial
restore or :meth:`~taskpoint.CheckpointManager.open` then reads, with ranged reads, only the members that hold
the entries it needs, each verified by the codec's own check (gzip: CRC32 and ISIZE of every member).

The index is kept in the step's manifest or the checkpoint's record, whose digest covers it; it is JSON::

    {"codec": "gzip", "members": [[compressed, plain], ...],
     "entries": [[name, type, header, data, size, link], ...]}

``type`` is ``f`` (file), ``d`` (folder), ``l`` (symlink) or ``h`` (hard link to ``link``); offsets are in the
plain tar stream. Any codec whose :meth:`~.codecs.Codec.members` lists independent members gets one.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: Size of a tar block: entries start and end on these.
TAR_BLOCK = 512
#: Entry types as the index writes them.
FILE, FOLDER, SYMLINK, HARDLINK = "f", "d", "l", "h"


@dataclass(frozen=True)
class IndexEntry:
    """One tar entry: its path below the saved directory, type, and offsets in the plain tar stream."""

    name: str
    type: str
    #: Where its first header block (pax records included) starts.
    header: int
    #: Where its data starts (equal to :attr:`end` for entries without data).
    data: int
    size: int
    #: The target of a hard link (the entry it shares its data with); empty otherwise.
    link: str = ""

    @property
    def end(self) -> int:
        """Where the next entry starts: after the data and its padding to a tar block."""
        return self.data + self.size + (-self.size % TAR_BLOCK)


@dataclass(frozen=True)
class Span:
    """One compressed member: where it is in the stored object, and which plain bytes it holds."""

    index: int
    stored: int
    stored_length: int
    plain: int
    plain_length: int


def normalize_path(path: str) -> str:
    """``path`` as entries name it (``model/``, ``./model`` -> ``model``); ValueError for one that could not
    name anything inside a saved directory (absolute, ``..``, empty)."""
    if not isinstance(path, str):
        raise TypeError(f"paths must be str, relative to the saved directory; got {type(path).__name__}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if path.startswith("/") or ".." in parts or not parts:
        raise ValueError(f"{path!r} is not a path inside the saved directory: give a relative path such as "
                         "'model/weights.bin' or 'model/'")
    return "/".join(parts)


def normalize_paths(paths: Iterable[str]) -> list[str]:
    """Every path of ``paths`` normalized (:func:`normalize_path`); a bare str is refused (it would be read as
    its characters)."""
    if isinstance(paths, (str, bytes)):
        raise TypeError("paths must be a list of relative paths, e.g. paths=['model/'], not one str")
    found = [normalize_path(p) for p in paths]
    if not found:
        raise ValueError("paths is empty: name at least one file or folder to restore")
    return found


def covered(name: str, paths: Sequence[str]) -> str | None:
    """The path of ``paths`` that selects the entry ``name`` (itself, or a folder above it), if any."""
    return next((p for p in paths if name == p or name.startswith(p + "/")), None)


@dataclass(frozen=True)
class ArchiveIndex:
    """Where every entry of one archive lies (see the module)."""

    codec: str
    #: (compressed length, plain length) of each member, in order.
    members: tuple[tuple[int, int], ...]
    entries: tuple[IndexEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "members": [list(m) for m in self.members],
                "entries": [[e.name, e.type, e.header, e.data, e.size, e.link] for e in self.entries]}

    @classmethod
    def from_json(cls, doc: Any) -> ArchiveIndex:
        """The index in ``doc``; ValueError (TypeError, KeyError) when malformed: the manifest or record that
        holds it is then reported damaged."""
        members = tuple((int(c), int(p)) for c, p in doc["members"])
        entries = tuple(IndexEntry(str(n), str(t), int(h), int(d), int(s), str(k)) for n, t, h, d, s, k
                        in doc["entries"])
        if any(c <= 0 or p < 0 for c, p in members):
            raise ValueError("an index member has no length")
        if any(e.type not in (FILE, FOLDER, SYMLINK, HARDLINK) or not e.header <= e.data or e.size < 0
               for e in entries):
            raise ValueError("an index entry is malformed")
        index = cls(str(doc["codec"]), members, entries)
        if entries and entries[-1].end > index.plain_size:
            raise ValueError("an index entry lies beyond the archive's members")
        return index

    @functools.cached_property
    def _starts(self) -> tuple[list[int], list[int]]:
        stored, plain = [0], [0]
        for c, p in self.members:
            stored.append(stored[-1] + c)
            plain.append(plain[-1] + p)
        return stored, plain

    @property
    def plain_size(self) -> int:
        return self._starts[1][-1]

    @property
    def stored_size(self) -> int:
        return self._starts[0][-1]

    def span(self, i: int) -> Span:
        stored, plain = self._starts
        return Span(i, stored[i], self.members[i][0], plain[i], self.members[i][1])

    def spans(self, start: int, end: int) -> list[Span]:
        """The members holding the plain bytes ``[start, end)``, in order."""
        if end <= start:
            return []
        plain = self._starts[1]
        first = bisect.bisect_right(plain, start) - 1
        last = bisect.bisect_left(plain, end) - 1
        return [self.span(i) for i in range(max(first, 0), min(last, len(self.members) - 1) + 1)]

    def select(self, paths: Sequence[str]) -> list[IndexEntry]:
        """The entries ``paths`` (normalized) name, folders with everything below them, plus the files their
        hard links share data with; in archive order. KeyError naming a path that matches no entry."""
        chosen = {e.name: e for e in self.entries if covered(e.name, paths) is not None}
        missing = [p for p in paths if p not in chosen and not any(n.startswith(p + "/") for n in chosen)]
        if missing:
            raise KeyError(f"not in this checkpoint: {', '.join(map(repr, missing))}")
        by_name = {e.name: e for e in self.entries}
        for entry in list(chosen.values()):
            target = by_name.get(entry.link) if entry.type == HARDLINK else None
            if target is not None:
                chosen.setdefault(target.name, target)
        return sorted(chosen.values(), key=lambda e: e.header)

    def file(self, path: str) -> IndexEntry:
        """The regular file ``path`` (a hard link: the file it shares data with, under this name). KeyError when
        the archive has no such entry; IsADirectoryError for a folder; ValueError for a symlink."""
        name = normalize_path(path)
        by_name = {e.name: e for e in self.entries}
        entry = by_name.get(name)
        if entry is None:
            raise KeyError(f"not in this checkpoint: {path!r}")
        if entry.type == HARDLINK and entry.link in by_name:
            entry = by_name[entry.link]
        if entry.type == FOLDER:
            raise IsADirectoryError(f"{path!r} is a folder of the checkpoint, not a file")
        if entry.type != FILE:
            raise ValueError(f"{path!r} is a symlink in the checkpoint; open the file it points to")
        return entry


def merged_ranges(entries: Iterable[IndexEntry]) -> list[tuple[int, int]]:
    """The plain ranges ``[header, end)`` of ``entries`` (in archive order), adjacent ones joined."""
    ranges: list[tuple[int, int]] = []
    for e in entries:
        if ranges and ranges[-1][1] >= e.header:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], e.end))
        else:
            ranges.append((e.header, e.end))
    return ranges
