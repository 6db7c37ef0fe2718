"""Staging in shared memory: where a background save copies its state once, for the save process to write.

A background save of a state in memory (a torch state dict, a JAX PyTree) copies it once into a *segment*: files in
``/dev/shm`` (tmpfs: its pages are memory, shared by every process that maps it; one file per thread that fills it,
:mod:`.segment_files`), sized up front (a folder without room
for it is a clean ``OSError`` before a byte is copied), its pages allocated by the copy's own ``pwrite`` calls
(:meth:`Segment.fill`), or reserved first with ``posix_fallocate`` where the copy goes through a mapping
(:meth:`Segment.reserve`), so that a full ``/dev/shm`` is never a ``SIGBUS`` in the middle. The segment is named for the
save process from the start (:func:`owner_tag` of its pid), so that its ownership needs no round trip: only its name
goes to the save process, which writes the step from it and removes it (or keeps it for the manager's next save:
:mod:`.staging_memory`). The trainer may change its tensors, exit or be killed as soon as ``save()`` returned, which it
does once the request is in the pipe (see :mod:`.saver`).
A segment's name says who owns it: ``taskpoint-stage-<host>-<pid>-<start>-<random>``, ``<start>`` the owner's
start time (``/proc/<pid>/stat``), so that a pid reused by another process does not keep a dead owner's segment.
:func:`sweep_dead_segments` removes those whose owner is gone (a save process killed in the middle of a write),
never one whose owner runs: the way leftovers in storage are swept.

:class:`StagingBudget` bounds the memory the segments of one manager hold (``max_staging_bytes``).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .._log import logger
from ..executors import CPU
from ..payloads import Payload
from ..workspace import owner_tag, sweep_dead
from .segment_files import map_parts, part_count, part_files, part_path, part_paths, part_sizes, spread, stored_size

#: Start of a segment's name: ``taskpoint-stage-<host>-<pid>-<start>-<random>``.
SEGMENT_PREFIX = "taskpoint-stage-"
#: Where segments are made: tmpfs, whose files are memory.
SHARED_MEMORY = "/dev/shm"
#: The environment variable that names another folder for the segments (a container's small ``/dev/shm``, say).
STAGING_DIR_VARIABLE = "TASKPOINT_STAGING_DIR"
#: The share of the machine's available memory (and of the free space of the segments' folder) that the
#: default ``max_staging_bytes`` allows: the other half stays for the training loop and the save process.
DEFAULT_STAGING_SHARE = 0.5
#: How often a save that waits for staging memory says so in the log while it waits.
WAIT_LOG_SECONDS = 10.0
#: The bytes of one ``pwrite`` of :meth:`Segment.fill`: a large tensor is written in such parts, several at once.
FILL_PART = 8 << 20
_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-(?P<key>[0-9a-f]+)")


def segment_folder() -> Path:
    """``$TASKPOINT_STAGING_DIR`` when set, else ``/dev/shm`` where it is a writable folder, else the temp folder (a
    disk: slower, never wrong). The trainer and its save process read it alike: the save process inherits it."""
    if chosen := os.environ.get(STAGING_DIR_VARIABLE):
        return Path(chosen)
    if os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK | os.X_OK):
        return Path(SHARED_MEMORY)
    return Path(tempfile.gettempdir())


class Segment:
    """One staging segment (a file in :func:`segment_folder`) and the mapping of its bytes in this process."""

    #: Where each thing staged in a segment starts: a multiple of this many bytes (jax's CPU client aliases only an
    #: aligned host buffer; ``torch.save`` aligns storages so in its file).
    ALIGN = 64

    @classmethod
    def aligned(cls, offset: int) -> int:
        """The first :attr:`ALIGN` boundary at or after ``offset``: where the next thing staged starts."""
        return -(-offset // cls.ALIGN) * cls.ALIGN

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self._map: memoryview | None = None

    @classmethod
    def create(cls, size: int, owner: str | None = None, folder: Path | None = None) -> Segment:
        """A new segment of ``size`` bytes, owned by the process ``owner`` names (an :func:`owner_tag`; this
        process by default), not mapped here (:meth:`fill` writes it): one file per thread of the CPU pool that fills
        it (:mod:`.segment_files`). ``OSError`` with ``ENOSPC`` when the folder has less room than that, nothing left
        behind. Its pages are not allocated yet: :meth:`fill`'s ``pwrite`` calls allocate them as they copy, on its
        threads at once, where reserving them first (``posix_fallocate``) is a pass of its own over the pages, in the
        first save's blocked time: measured here, 256 MiB in ``/dev/shm``, 9 alternating rounds at load 3-5, reserved
        then filled 1.09x a ``clone()`` of the tensors (median of per-round ratios), filled without reserving 0.80x."""
        folder = folder or segment_folder()
        _check_room(folder, size)
        owner = owner or owner_tag(os.getpid())
        segment = cls(folder / f"{SEGMENT_PREFIX}{owner}-{secrets.token_hex(8)}", 0)
        made: list[Path] = []
        try:
            for index, part in enumerate(part_sizes(size, part_count(size, CPU.threads))):
                path = part_path(segment.path, index)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                made.append(path)
                try:
                    os.ftruncate(fd, part)
                finally:
                    os.close(fd)
            segment.size = size
        except BaseException:
            for path in made:
                path.unlink(missing_ok=True)
            raise
        return segment

    def resize(self, size: int) -> None:
        """Make this segment ``size`` bytes, for a save that reuses it: a no-op when it is that size already, else
        its pages past ``size`` are freed and those it lacks left to :meth:`fill` (``OSError`` as :meth:`create`
        when the folder has no room for them), the others kept as they are, with no zeroing (and a mapping here
        of the old size dropped); it keeps its number of files. FileNotFoundError when it is gone."""
        fds: list[int] = []
        try:
            fds.extend(os.open(path, os.O_RDWR | os.O_CLOEXEC) for path in part_paths(self.path))
            if size != self.size:
                self.unmap()
                if size > self.size:
                    _check_room(self.path.parent, size - self.size)
                for fd, part in zip(fds, part_sizes(size, len(fds)), strict=True):
                    os.ftruncate(fd, part)
                self.size = size
        finally:
            for fd in fds:
                os.close(fd)

    def reserve(self) -> None:
        """Allocate every page of the segment now (``posix_fallocate`` of each of its files, at once on the CPU
        pool's threads; ``OSError`` with ``ENOSPC`` when the folder cannot hold them), for a copy that writes it
        through a mapping (:attr:`buffer`), where a page the folder has no room for would be a ``SIGBUS`` in the
        middle; :meth:`fill` needs none."""
        if self.size:
            parts = part_files(self.path)
            with CPU.lane(len(parts)) as lane:
                for _ in lane.map(lambda part: _allocate(*part), parts):
                    pass

    def fill(self, pieces: Iterable[tuple[int, Any]]) -> None:
        """Write each ``(offset, data)`` of ``pieces`` (``data`` any contiguous buffer) into the segment at ``offset``,
        by ``pwrite`` in parts of :data:`FILL_PART` bytes on the shared CPU pool's threads: the trainer's copy of its
        state. Into pages not yet written (allocated by the ``pwrite`` itself, or reserved), ``pwrite`` copies without
        the kernel zeroing them first, and it needs no mapping, whose page faults (or ``MAP_POPULATE``) cost more than
        the copy: measured here for 256 MiB (4 tensors, one thread, median of 9, load 2-4), a fresh segment reserved
        (``posix_fallocate``, as it was then) and filled in 0.18 s (0.54x a ``clone()`` of the tensors into fresh
        memory, 0.32 s), against 0.44 s (1.35x) reserved, mapped with ``MAP_POPULATE`` and copied into, and 0.33 s
        mapped and faulted in by the copy; into pages written before, 0.14 s, as fast as a copy into a mapping of them.
        The parts go on several threads as ``clone()`` and torch's copies do: on a busy machine one thread got less of
        the cores than they (a later save 0.54x the clone with one, against 0.36x for torch's copy into a mapping, 8
        rounds at load 8-18; 0.42x against 0.56x with the parts on the pool, 7 rounds at load 9-20).
        The segment's files (one per thread: :mod:`.segment_files`) are taken in turn, so that the threads write,
        and allocate the pages of, files of their own."""
        fds: list[int] = []
        try:
            fds.extend(os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in part_paths(self.path))
            parts = [(offset + start, view[start:start + FILL_PART]) for offset, data in pieces
                     for view in (memoryview(data).cast("B"),) for start in range(0, view.nbytes, FILL_PART)]
            writes = spread(parts, [os.fstat(fd).st_size for fd in fds])
            with CPU.lane(CPU.threads) as lane:
                for _ in lane.map(lambda write: _write_at(fds[write[0]], *write[1:]), writes):
                    pass
        finally:
            for fd in fds:
                os.close(fd)

    @classmethod
    def adopt(cls, path: str | os.PathLike[str]) -> Segment:
        """Take the segment at ``path`` over: renamed to this process's own name (a rename of each of its files, the
        head's last: none when it is named for this process already), so that no sweep removes it while this process
        runs (mapped by :attr:`buffer`). FileNotFoundError when it is gone."""
        old = Path(path)
        match = _NAME.fullmatch(old.name)
        if match is None:
            raise ValueError(f"{old} is not a staging segment")
        new = old.with_name(f"{SEGMENT_PREFIX}{owner_tag(os.getpid())}-{match['key']}")
        if new != old:
            for index in reversed(range(len(part_paths(old)))):
                os.rename(part_path(old, index), part_path(new, index))
        return cls(new, stored_size(new))

    @staticmethod
    def find(path: str | os.PathLike[str]) -> Path | None:
        """The segment that was at ``path`` (under any owner's name now), or None when it was removed."""
        old = Path(path)
        match = _NAME.fullmatch(old.name)
        if match is None:
            return None
        return next(old.parent.glob(f"{SEGMENT_PREFIX}*-{match['key']}"), None)

    @property
    def buffer(self) -> memoryview:
        """The segment's bytes, writable (empty for a segment of no bytes), mapped here on first use (the save
        process reads the state there; its pages are faulted in as they are read): its files at consecutive
        addresses (:func:`~.segment_files.map_parts`). FileNotFoundError when it is gone."""
        if self._map is None and self.size:
            files = part_files(self.path)
            if len(files) == 1:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    self._map = memoryview(mmap.mmap(fd, self.size))
                finally:
                    os.close(fd)
            else:
                self._map = map_parts(files)
        return self._map if self._map is not None else memoryview(bytearray())

    def unmap(self) -> None:
        """Drop this process's mapping (the segment stays; its pages are no longer counted here): at once, or when
        the last view of it still held elsewhere goes."""
        self._map = None

    def free(self) -> None:
        """Unmap and remove the segment. Its pages go back at once, even while the save process still maps it
        (it keeps a segment it wrote mapped, idle, for the next save: :mod:`.staging_memory`), as it is emptied
        first; so it is freed only where no process reads it any more."""
        self.unmap()
        for path in reversed(part_paths(self.path)):
            with contextlib.suppress(FileNotFoundError):
                os.truncate(path, 0)
            path.unlink(missing_ok=True)


def _check_room(folder: Path, size: int) -> None:
    """``OSError`` with ``ENOSPC`` when ``folder``'s file system has fewer than ``size`` bytes free: said before a
    byte is copied (a ``pwrite`` that finds no room later fails as cleanly, the segment then freed)."""
    free = _free_bytes(folder)  # None: the create that follows says what is wrong with the folder
    if free is not None and size > free:
        raise OSError(errno.ENOSPC, f"{folder} has {free} bytes free, a staging segment needs {size}", str(folder))


def _free_bytes(folder: Path) -> int | None:
    """The bytes an unprivileged writer may still use on ``folder``'s file system; None when it cannot be asked."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _allocate(path: Path, size: int) -> None:
    """Allocate the pages of the file ``path`` of ``size`` bytes (``posix_fallocate``)."""
    if size:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)


def _write_at(fd: int, offset: int, view: memoryview) -> None:
    """Write all of ``view`` at ``offset`` of ``fd`` (a ``pwrite`` may write less than it was given)."""
    written = 0
    while written < view.nbytes:
        written += os.pwrite(fd, view[written:], offset + written)


def sweep_dead_segments(folder: Path | None = None) -> list[Path]:
    """Remove the segments of this host in ``folder`` whose owner is gone (no process with that pid, or one
    started at another time: :func:`~taskpoint.workspace.sweep_dead`); return them. A segment whose owner runs is
    never touched, whatever its age."""
    removed = sweep_dead(folder or segment_folder(), SEGMENT_PREFIX, os.unlink)
    if removed:
        logger.info("removed %d staging segment(s) left by save processes that are gone: %s", len(removed),
                    [path.name for path in removed])
    return removed


def free_owned_segments(owner: str, folder: Path | None = None) -> list[Path]:
    """Remove the segments named for ``owner`` (an :func:`owner_tag`); return them. A save process whose trainer
    died calls it as it leaves, for a segment staged for it whose request the trainer did not live to send."""
    removed = []
    for path in (folder or segment_folder()).glob(f"{SEGMENT_PREFIX}{owner}-*"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


@runtime_checkable
class Stageable(Protocol):
    """A payload that a background save copies into a segment (:meth:`stage`) instead of a snapshot folder."""

    #: The step kind that writes it staged: a background save stages it only when that kind saves it (not when
    #: the kind of several ranks wraps it, say).
    staged_kind: str

    def staging_size(self) -> int | None:
        """The bytes its segment needs, known before anything is copied; None when this one cannot be staged."""
        ...

    def stage(self, segment: Segment) -> Payload:
        """Copy the state into ``segment`` (of :meth:`staging_size` bytes); the payload the save then writes,
        which reads the segment, never the caller's state."""
        ...


def default_staging_bytes() -> int:
    """The default bound of a manager's staging: :data:`DEFAULT_STAGING_SHARE` of the memory the machine has
    available (``MemAvailable``) when the manager is made, and no more than that share of the free space of the
    segments' folder (tmpfs has a size of its own, half the RAM by default)."""
    available = _available_memory()
    free = _free_bytes(segment_folder())
    if free is not None:
        available = min(available, free)
    return int(available * DEFAULT_STAGING_SHARE)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_staging_bytes(limit: Any) -> int | None:
    """``max_staging_bytes`` when it is a positive int or None; ValueError otherwise."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
        raise ValueError(f"max_staging_bytes must be a positive int or None, not {limit!r}")
    return limit


class StagingBudget:
    """The staging bytes a manager's background saves hold, at most ``limit``: :meth:`reserve` waits until the
    segments of earlier saves are freed, and refuses a state larger than the limit (which is then saved
    blocking)."""

    def __init__(self, limit: int | None) -> None:
        checked = check_staging_bytes(limit)
        self.limit = default_staging_bytes() if checked is None else checked
        self._held = 0
        self._freed = threading.Condition()

    @property
    def held(self) -> int:
        """The bytes reserved now."""
        return self._held

    def reserve(self, size: int, step: int) -> bool:
        """Hold ``size`` bytes until :meth:`release`, waiting until they fit; False, holding nothing, when
        ``size`` exceeds the limit. A wait is logged when it ends, with how long it took, and every
        :data:`WAIT_LOG_SECONDS` while it lasts (it ends when an earlier save ends, which every save does)."""
        if size > self.limit:
            logger.info("step %d: its %d bytes exceed max_staging_bytes (%d); it is saved blocking", step, size,
                        self.limit)
            return False
        began, waited = time.monotonic(), False
        with self._freed:
            while self._held + size > self.limit:
                waited = True
                if not self._freed.wait(WAIT_LOG_SECONDS):
                    logger.info("step %d waits for %d staging bytes (%d of %d held) since %.1f s", step, size,
                                self._held, self.limit, time.monotonic() - began)
            self._held += size
        if waited:
            logger.info("step %d: staged after waiting %.3f s for earlier saves' segments to be freed", step,
                        time.monotonic() - began)
        return True

    def reserve_now(self, size: int) -> bool:
        """Hold ``size`` bytes until :meth:`release` when they fit now; False, holding nothing, when they do not
        (no wait: for a segment made ahead, which no save waits for)."""
        with self._freed:
            if self._held + size > self.limit:
                return False
            self._held += size
        return True

    def release(self, size: int) -> None:
        """Give back ``size`` bytes a :meth:`reserve` held."""
        with self._freed:
            self._held -= size
            self._freed.notify_all()
