"""Snapshots of background saves that copy only the files that changed since the last one.

A background save copies the caller's directory before it returns, so that the caller may change it at once.
Most steps of a training run rewrite a few files of a folder and leave the rest; copying those again costs the
caller time for nothing. :class:`SnapshotCache` keeps the last snapshot after its upload, and the next one
takes a file from it (a hard link: no bytes copied) when the source file is unchanged since it was copied.

"Unchanged" is judged from ``lstat``, the way ``git`` and ``rsync`` judge it: the same device, inode, size,
modification time and change time (``st_ctime`` moves with any write, chmod or rename onto the name). That is
cheap (no byte read) and safe under one condition: a write within the same tick of the file system's clock as
the copy leaves the times unchanged. So a file whose modification time was less than :data:`RACY_SECONDS`
before the snapshot began is never trusted, and is copied again next time (git's "racily clean" rule).
Hashing every file instead would be as slow as copying it. Not seen by ``lstat``: a file changed through a
writable ``mmap`` that was never flushed (the kernel updates the times at the flush); set
``TASKPOINT_SNAPSHOT_ALL=1`` to copy every file every time.

Deduplicated saves use the same judgement through :class:`ReadIndex`: a file unchanged since the last save
read it is not read or hashed again; its chunk list is taken from that save (see :mod:`.dedup`). The files
of a snapshot are taskpoint's own, written once and never again, so for those a hard link from the snapshot
before (which changes the change time, and nothing else) is proof enough.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._log import logger
from ..format.codecs import get_codec
from ..payloads import BytesPayload, DirectoryPayload, FilePayload, Payload, special_entries
from ..storage.localio import ParallelCopy

#: A file modified less than this before a snapshot began is copied again by the next one.
RACY_SECONDS = 2.0
#: Set to 1 to copy every file of every snapshot.
ENV_SNAPSHOT_ALL = "TASKPOINT_SNAPSHOT_ALL"

Identity = tuple[int, int, int, int, int]


def _identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def trust_lstat() -> bool:
    """Whether unchanged files may be judged by ``lstat`` (False with ``TASKPOINT_SNAPSHOT_ALL=1``)."""
    return os.environ.get(ENV_SNAPSHOT_ALL, "") not in ("1", "true")


class Snapshot(DirectoryPayload):
    """The folder of a background save's snapshot. ``linked`` names its files (relative paths) that are hard
    links to the files of the snapshot before: the same bytes, unchanged since that one was taken."""

    def __init__(self, path: Path, linked: frozenset[str] = frozenset()) -> None:
        super().__init__(path)
        self.linked = linked


class SpooledBytes(FilePayload):
    """Bytes a background save wrote into its snapshot folder for the save process, which reads them from
    there: saved and restored as bytes, as if they had been sent whole."""

    kind = "bytes"

    def __reduce__(self) -> tuple[Any, ...]:
        return SpooledBytes, (self._path,)


def spool(payload: Payload, scratch: Path) -> Payload:
    """``payload`` for the save process: bytes written to ``scratch`` (a :class:`SpooledBytes`), anything else
    as it is. ``save()`` waits until the save process holds the payload, and bytes sent through its pipe
    need that process (at ``nice`` +10) to read them all: measured on the 2-core machine, ``save()`` of
    48 MiB returned in 211 ms through the pipe and 37 ms written here (median of 20), and with both cores
    busy in 1748 ms and 41 ms (median of 10)."""
    if type(payload) is not BytesPayload:
        return payload
    path = scratch / "payload"
    with open(path, "wb") as sink:
        payload.write(sink, get_codec("none"), None)
    return SpooledBytes(path)


@dataclass(frozen=True)
class _Read:
    identity: Identity  # the file's, before it was read
    stable: bool  # modified at least RACY_SECONDS before the save that read it began
    keys: tuple[str, ...]  # its chunks


class ReadIndex:
    """What the last deduplicated save read from each file (by device and inode), so that the next one can
    take the chunk list of a file that did not change instead of reading and hashing it again.

    Call :meth:`begin` when a save starts, :meth:`reuse` before reading a file, :meth:`record` after, and
    :meth:`commit` once the save stored every chunk: the index then holds the files of that save only.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], _Read] = {}
        self._next: dict[tuple[int, int], _Read] = {}
        self._began = 0

    def begin(self) -> None:
        self._next = {}
        self._began = time.time_ns() - int(RACY_SECONDS * 1e9)

    def reuse(self, st: os.stat_result, *, linked: bool) -> tuple[str, ...] | None:
        """The chunk keys of the file ``st`` describes when it is unchanged since the last save read it:
        every field of its identity the same and modified well before that read began; for a snapshot's file
        ``linked`` from the snapshot before, the same inode, size and modification time. Else None."""
        seen = self._last.get((st.st_dev, st.st_ino))
        if seen is None:
            return None
        now = _identity(st)
        same = now[:4] == seen.identity[:4] if linked else seen.stable and now == seen.identity
        if not same:
            return None
        self._next[(st.st_dev, st.st_ino)] = seen
        return seen.keys

    def record(self, before: os.stat_result, after: os.stat_result, keys: tuple[str, ...]) -> None:
        """A file was read as ``keys``; ``before`` and ``after`` are its status around the read. A file that
        changed meanwhile is not recorded (the step holds whatever was read; the next save reads it again)."""
        if _identity(before) == _identity(after):
            self._next[(before.st_dev, before.st_ino)] = _Read(_identity(before), before.st_mtime_ns < self._began,
                                                               keys)

    def commit(self) -> None:
        self._last, self._next = self._next, {}


class SnapshotCache:
    """The last snapshot of a directory payload, kept to link its unchanged files into the next one."""

    def __init__(self) -> None:
        self._folder: Path | None = None  # the kept snapshot folder (its files are under "tree")
        self._source: str | None = None  # the directory it copied
        self._index: dict[str, Identity] = {}  # relative path -> the source's identity when copied
        self._pending: tuple[Path, str, dict[str, Identity]] | None = None
        #: Files of the last snapshot linked from the one before, and files copied.
        self.linked = 0
        self.copied = 0

    def take(self, payload: Payload, scratch: Path) -> Payload | None:
        """A snapshot of ``payload`` below ``scratch``: files unchanged since the kept snapshot are linked from
        it, the others copied. Other kinds (a PyTree too, whose folder is its own) are snapshotted as they always
        are."""
        if type(payload) is not DirectoryPayload or not trust_lstat():
            return payload.snapshot(scratch)
        source = os.path.realpath(payload._path)
        reuse = self._index if self._folder is not None and self._source == source else {}
        began = time.time_ns() - int(RACY_SECONDS * 1e9)
        index: dict[str, Identity] = {}
        linked: set[str] = set()
        copy = scratch / "tree"
        self.linked = self.copied = 0

        def copy_one(src: str, dst: str, copier: ParallelCopy) -> str:
            rel = os.path.relpath(src, source)
            st = os.lstat(src)
            seen = _identity(st)
            if reuse.get(rel) == seen and self._folder is not None:  # (types: reuse is empty without one)
                try:
                    os.link(self._folder / "tree" / rel, dst)
                except OSError:  # no hard links here (another file system, a limit): copy it
                    pass
                else:
                    index[rel] = seen
                    linked.add(rel)
                    self.linked += 1
                    return dst
            copier(src, dst)
            self.copied += 1
            if stat.S_ISREG(st.st_mode) and st.st_mtime_ns < began:
                index[rel] = seen  # checked again below, once the copy is done
            return dst

        with ParallelCopy() as copier:  # waits for every copy, even when copytree raises
            shutil.copytree(payload._path, copy, symlinks=True, ignore=special_entries,
                            copy_function=lambda s, d: copy_one(s, d, copier))
        for rel, seen in list(index.items()):  # a file written during its copy is not trusted next time
            try:
                if _identity(os.lstat(os.path.join(source, rel))) != seen:
                    del index[rel]
            except OSError:
                del index[rel]
        self._pending = (scratch, source, index)
        logger.debug("snapshot of %s: %d file(s) linked from the last one, %d copied", source, self.linked,
                     self.copied)
        return Snapshot(copy, frozenset(linked))

    @property
    def kept(self) -> Path | None:
        """The folder of the kept snapshot (None when there is none)."""
        return self._folder

    def keep(self, scratch: Path) -> bool:
        """After the upload of the snapshot in ``scratch``: keep it for the next one (dropping the one kept
        before). False when it is not a snapshot this cache took: the caller removes it."""
        if self._pending is None or self._pending[0] != scratch:
            return False
        old, (self._folder, self._source, self._index) = self._folder, self._pending
        self._pending = None
        if old is not None and old != scratch:
            shutil.rmtree(old, ignore_errors=True)
        return True

    def drop(self) -> None:
        """Remove the kept snapshot (the manager closes)."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder, self._source, self._index, self._pending = None, None, {}, None

