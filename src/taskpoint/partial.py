"""Part of a stored directory archive: some of its files and folders restored, or one file opened for reading.

With the archive's index (recorded beside it at save, :mod:`taskpoint.format.index`) only the compressed members
that hold the wanted entries are read, with ranged reads, each verified by its codec; without one (a checkpoint
written by Flyte, by an older taskpoint, or with a codec that has no independent members) the whole archive is
streamed and verified as a full load does, keeping only those entries. The manager's step kinds and
:class:`~taskpoint.Checkpoint` both restore subsets through here.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ._progress import NO_PROGRESS, Progress
from .format.codecs import CODECS
from .format.index import ArchiveIndex
from .format.records import Record
from .format.subset import MemberReader, PieceFile, RangeReader, extract_entries, open_pieces, stored_bytes
from .payloads import DirectoryPayload
from .signals import uninterrupted
from .storage import Location
from .workspace import Staging


def indexed(index: ArchiveIndex | None, codec: str) -> bool:
    """Whether ``index`` can serve partial reads of an archive stored with ``codec``."""
    return index is not None and index.codec == codec and index.codec in CODECS


def listed_index(record: Record | None, size: int | None) -> ArchiveIndex | None:
    """The index of the object of ``size`` that a checkpoint's ``record`` lists: the confirmed save's when it
    has that size, else the only listed object of that size; None when none (or several) could be it."""
    if record is None or size is None:
        return None
    sized = [o for o in record.objects if o.size == size]
    entry = next((o for o in sized if o.save_id == record.confirmed), sized[0] if len(sized) == 1 else None)
    return entry.index if entry is not None and indexed(entry.index, entry.codec) else None


def restore_indexed(src: Location, index: ArchiveIndex, paths: Sequence[str], workspace: Path, *,
                    max_expand: int | None = None, progress: Progress = NO_PROGRESS,
                    read_range: RangeReader | None = None) -> Path:
    """Restore ``paths`` (normalized) of the archive at ``src`` into ``workspace`` by ranged reads of the members
    that hold them (staged, then published as a directory load is); returns ``workspace``. KeyError naming a
    path the archive lacks; CheckpointCorruptError when a member read fails its check; FileNotFoundError
    when the object is missing. ``progress`` counts the stored bytes of those members. ``read_range``: how the
    members are read (a step's object recorded by pieces: :class:`~taskpoint.format.pieces.CheckedRanges`, which
    checks each piece read); ``src.read_range`` when None."""
    entries = index.select(paths)
    progress.set_total(stored_bytes(index, entries))
    members = MemberReader(index, CODECS[index.codec], read_range or src.read_range, src.uri,
                           progress.update if progress.active else None)
    workspace.mkdir(parents=True, exist_ok=True)
    with Staging(workspace) as staging:
        extract_entries(members, entries, staging, max_expand=max_expand)
        with uninterrupted():  # a signal waits until every entry has landed
            return DirectoryPayload.publish(staging, workspace)


def open_indexed(src: Location, index: ArchiveIndex, path: str, read_range: RangeReader | None = None
                 ) -> io.BufferedReader:
    """The file ``path`` of the archive at ``src``, read on demand member by member, each verified before its
    bytes are returned (``read_range``: as :func:`restore_indexed` reads). KeyError when the archive has no such
    file."""
    entry = index.file(path)
    members = MemberReader(index, CODECS[index.codec], read_range or src.read_range, src.uri)
    spans = [index.span(i) for i in range(len(index.members))]
    raw = PieceFile([s.plain for s in spans], lambda i: members.fetch(spans[i]), entry.data, entry.size,
                    f"{src.uri}:{entry.name}")
    return open_pieces(raw)


def open_by_restoring(restore: Callable[[Path], Path], path: str) -> io.BufferedReader:
    """The file ``path`` restored alone by ``restore(folder)`` (an archive without an index: streamed) into a
    temporary folder, opened, and the folder removed: the open file is all that is left of it."""
    scratch = Path(tempfile.mkdtemp(prefix="taskpoint-open-"))
    try:
        folder = restore(scratch)
        target = folder / path
        if target.is_dir():
            raise IsADirectoryError(f"{path!r} is a folder of the checkpoint, not a file")
        return open(target, "rb")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
