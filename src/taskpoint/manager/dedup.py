"""Deduplicated steps: a step's files cut into fixed-size chunks, each stored once in the directory's chunk store.

A save walks the payload (a directory; bytes and single files are one-file trees), hashes every chunk,
uploads in parallel only the chunks the store does not hold, and returns the tree that the step's manifest
records. A file unchanged since the last save of this manager read it (judged by ``lstat``, as
:mod:`.snapshots` explains) is not read again: its chunk list is that save's, once every chunk in it is known
to be stored. Restores are :mod:`.rebuild`'s. :meth:`Dedup.collect` removes the chunks that no manifest names.

Why a save never commits a step naming a deleted chunk is argued in docs/manager.md: a save writes its lease
before it decides which chunks are stored and removes it only after its manifest; a sweep writes its lock
before it lists the leases, removes nothing while a fresh save lease exists, and rewrites the epoch before
its first removal, then reads the manifests again. Both write before they list, so of a save and a sweep that
overlap, at least one sees the other. A save does not trust its own clock to know that its lease stayed
fresh (a process stopped by SIGSTOP resumes with its heartbeat): it reads the epoch before and after its
commit, and a sweep that began removing meanwhile makes it fail rather than commit. A sweep's lock has a
heartbeat (:class:`.leases.Heartbeat`): a save waits for a sweep only while it beats, so a killed sweep costs it
seconds, not the grace; it fences off a sweep it takes for dead by rewriting the epoch, and the sweep checks its
heartbeat before every removal and the epoch every :data:`REMOVAL_BATCH` removals.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from .. import _log
from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError, SaveStalledError
from ..format.tree import ChunkedTree
from ..payloads import BytesPayload, DirectoryPayload, Payload
from .chunks import ChunkStore, source_tree
from .leases import SWEEP_BEAT, Heartbeat, fresh, heartbeat, renewing
from .snapshots import ReadIndex, Snapshot, trust_lstat
from .steps import StepStore, best_effort
from .sweep_wait import settled_epoch

#: Size of a chunk: 4 MiB (see docs/manager.md for why fixed-size chunks, and why this size).
CHUNK_SIZE = 4 << 20
#: Chunks hashed, compressed and uploaded (or fetched and written) at once.
WORKERS = 8
#: Chunks a sweep removes between two readings of the epoch (its heartbeat it checks before every removal).
REMOVAL_BATCH = 16
#: Payload kinds a deduplicated step can hold; other kinds (extras) are saved as one payload object.
KINDS = ("bytes", "file", "directory")


@dataclass
class SaveStats:
    """What one deduplicated save did: plain bytes in the tree, chunks in it, chunks and bytes uploaded, and
    the plain bytes of the files it did not read because they were unchanged since the last save."""

    size: int = 0
    chunks: int = 0
    uploaded_chunks: int = 0
    uploaded_bytes: int = 0
    unread_bytes: int = 0


class Dedup:
    """Deduplicated saves, restores and chunk collection for one manager directory."""

    def __init__(self, steps: StepStore, chunks: ChunkStore, grace: float, chunk_size: int = CHUNK_SIZE,
                 workers: int = WORKERS) -> None:
        self.steps = steps
        self.chunks = chunks
        self.grace = grace
        self.chunk_size = chunk_size
        self.workers = workers
        self._known_lock = threading.Lock()
        self._lease_epoch: bytes | None = None  # the epoch when the lease of the save in flight began
        self._reads = ReadIndex()  # what the last save read from each file
        #: The figures of the last deduplicated save.
        self.last: SaveStats | None = None
        self._swept_deleted = 0  # steps.deleted at the last sweep of a save
        self._swept_at = 0.0
        self._unswept = False  # the last sweep left unreferenced chunks (younger than the grace, or blocked)

    # -- the save's lease ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self) -> Iterator[None]:
        """Hold a save lease for the block: written first, kept fresh, removed after the block (the commit).
        Inside it, :meth:`commit` writes the manifest only if no sweep began removing chunks meanwhile."""
        name = self.chunks.new_lease("save", self.grace)
        try:
            with renewing(lambda: self.chunks.write_lease(name, self.grace), self.grace, "taskpoint-lease"):
                self._lease_epoch = self._settled_epoch()
                if self.chunks.known is None or self._lease_epoch != self.chunks.epoch:
                    self.chunks.known = set(self.chunks.listing())  # a sweep removed chunks: list the store again
                    self.chunks.epoch = self._lease_epoch
                yield
        finally:
            best_effort(lambda: self.chunks.remove_lease(name))

    def _settled_epoch(self) -> bytes | None:
        """The epoch once no sweep is in flight (:func:`.sweep_wait.settled_epoch`)."""
        return settled_epoch(self.chunks, self.grace, self.steps.directory)

    def commit(self, tree: ChunkedTree, write: Callable[[], None], undo: Callable[[], None]) -> None:
        """Write the manifest naming ``tree`` with ``write`` (inside :meth:`lease`), unless a sweep began removing
        chunks since the lease began; if one began while the manifest was being written, check, once it is
        over, that every chunk ``tree`` names is still stored, and otherwise ``undo`` the manifest. Raises
        :class:`SaveStalledError` when nothing is committed."""
        if self.chunks.read_epoch() != self._lease_epoch:
            raise self._stalled("nothing was committed")
        write()
        if self.chunks.read_epoch() == self._lease_epoch:
            return  # a sweep that starts removing later reads the manifests again after its epoch: it sees ours
        epoch = self._settled_epoch()  # the sweep that moved it is over (or stopped removing)
        stored = self.chunks.listing()
        self.chunks.known, self.chunks.epoch = set(stored), epoch
        missing = tree.chunk_keys() - stored.keys()
        if missing:
            undo()
            raise self._stalled(f"{len(missing)} of the chunks it names had been removed, so its manifest was "
                                "removed again")

    def _swept_meanwhile(self) -> bool:
        """Whether the epoch moved since the lease began (best effort: False when it cannot be read)."""
        try:
            return self.chunks.read_epoch() != self._lease_epoch
        except Exception:
            return False

    def _stalled(self, outcome: str) -> SaveStalledError:
        return SaveStalledError(
            f"a deduplicated save to {self.steps.directory} was stalled past its lease: a sweep took the save for "
            f"dead (its lease older than the grace of {self.grace:g} s, or of the sweep's) and removed chunks while "
            f"it ran; {outcome}. Save again; if the process is paused for long (a debugger, SIGSTOP, a frozen VM), "
            "raise grace_seconds above the longest pause.")

    # -- saving --------------------------------------------------------------------------------------------

    def store(self, payload: Payload, progress: Progress = NO_PROGRESS) -> tuple[int, None, ChunkedTree]:
        """Upload the chunks of ``payload`` that the store lacks (call inside :meth:`lease`); return its size,
        no digest (each chunk is named by its own), and its tree. :attr:`last` has the figures. ``progress``
        counts the plain bytes of the files, each chunk once it is hashed and, when new, stored."""
        entries, files, view = source_tree(payload)
        progress.set_total(sum(entry.size for entry in entries if entry.type == "file"))
        stats = SaveStats()
        size = self.chunk_size
        linked = payload.linked if isinstance(payload, Snapshot) else frozenset()
        reads = self._reads if trust_lstat() else None
        if reads is not None:
            reads.begin()
        slots = threading.BoundedSemaphore(2 * self.workers)  # chunks in memory at once
        try:
            # Its own pool, not a lane of taskpoint.executors: a chunk's write may go up in parts on a lane of
            # the IO pool and wait for them (a chunk_size above one part), which could deadlock a shared pool.
            with concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="taskpoint-chunk") as pool:
                pending: list[tuple[int, list[concurrent.futures.Future[tuple[str, int]]], os.stat_result | None]] = []
                for index, entry in enumerate(entries):
                    if entry.type != "file":
                        continue
                    path = files.get(entry.path)
                    before = os.stat(path) if reads is not None and path is not None else None
                    keys = self._unchanged(reads, before, entry.path in linked, entry.size)
                    if keys is not None:
                        entries[index] = replace(entry, chunks=keys)
                        stats.size += entry.size
                        stats.chunks += len(keys)
                        stats.unread_bytes += entry.size
                        progress.update(entry.size)
                        continue
                    futures = []
                    for offset in range(0, entry.size, size):
                        length = min(size, entry.size - offset)
                        slots.acquire()
                        future = pool.submit(self._store_chunk, files.get(entry.path), view, offset, length, progress)
                        future.add_done_callback(lambda _: slots.release())
                        futures.append(future)
                    pending.append((index, futures, before))
                for index, futures, before in pending:
                    results = [future.result() for future in futures]
                    entries[index] = replace(entries[index], chunks=tuple(k for k, _ in results))
                    if reads is not None and before is not None:
                        reads.record(before, os.stat(files[entries[index].path]), entries[index].chunks)
                    stats.size += entries[index].size
                    stats.chunks += len(results)
                    stats.uploaded_chunks += sum(1 for _, sent in results if sent)
                    stats.uploaded_bytes += sum(sent for _, sent in results)
        except Exception as exc:
            if self._swept_meanwhile():
                # A sweep took this save for dead and removed what it was writing (on local disk, the temp file
                # of a chunk): say that, not what the write ran into.
                raise self._stalled(f"a chunk write failed ({exc}) and nothing was committed") from exc
            raise
        self.last = stats
        if reads is not None:
            reads.commit()
        return stats.size, None, ChunkedTree(chunk_size=size, entries=tuple(entries))

    def _unchanged(self, reads: ReadIndex | None, before: os.stat_result | None, linked: bool, size: int
                   ) -> tuple[str, ...] | None:
        """The chunk keys of a file unchanged since the last save read it, when every one is known stored."""
        if reads is None or before is None or before.st_size != size:
            return None
        keys = reads.reuse(before, linked=linked)
        if keys is None or len(keys) != -(-size // self.chunk_size):
            return None
        with self._known_lock:
            known = self.chunks.known
            return keys if known is not None and all(key in known for key in keys) else None

    def _store_chunk(self, path: Path | None, view: memoryview | None, offset: int, length: int,
                     progress: Progress) -> tuple[str, int]:
        """Hash one chunk; upload it when the store lacks it. Returns its key and the bytes uploaded."""
        if view is not None:
            data: bytes | memoryview = view[offset:offset + length]
        else:
            assert path is not None
            with open(path, "rb", buffering=0) as f:
                data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise RuntimeError(f"{path} changed size while it was being saved; save it again once it is "
                                   "complete")
        key = self.chunks.key_of(data)
        known = self.chunks.known
        assert known is not None
        with self._known_lock:
            if key in known:
                progress.update(length)
                return key, 0
        blob = self.chunks.compress(data)
        self.chunks.put(key, blob)
        with self._known_lock:
            known.add(key)
        progress.update(length)
        return key, len(blob)

    # -- collecting unreferenced chunks --------------------------------------------------------------------

    def sweep_due(self) -> bool:
        """Whether a save, after its commit, should sweep the chunk store: a step was deleted here since the
        last sweep, or that sweep left unreferenced chunks and the grace has passed since."""
        return self.steps.deleted != self._swept_deleted or (
            self._unswept and time.time() - self._swept_at >= self.grace)

    def sweep(self) -> list[str]:
        """The sweep of a save (after its commit): :meth:`sweep_chunks` with the manager's grace."""
        self._swept_deleted, self._swept_at = self.steps.deleted, time.time()
        return self.sweep_chunks(self.grace)

    def sweep_chunks(self, grace: float, *, dry_run: bool = False) -> list[str]:
        """Remove the chunks that no committed manifest names, older than ``grace``, unless a save is in flight
        (a fresh save lease, by the longer of ``grace`` and its own); return their URIs. Also removes leases
        stale by that rule (of killed saves) and temp files older than ``grace``. The sweep's lock has a
        heartbeat (:class:`.leases.Heartbeat`), and the sweep stops removing once it lapsed or a save fenced it off
        (the epoch it wrote changed)."""
        if not self.chunks.listing() and not self.chunks.leases() and not self.chunks.temp_files():
            return []
        if dry_run:
            return self._sweep(grace, None, None)
        lock = self.chunks.new_lease("gc", grace, SWEEP_BEAT)
        try:
            with heartbeat(lambda: self.chunks.write_lease(lock, grace, SWEEP_BEAT), SWEEP_BEAT,
                           "taskpoint-sweep-lock") as pulse:
                return self._sweep(grace, lock, pulse)
        finally:
            best_effort(lambda: self.chunks.remove_lease(lock))

    def _sweep(self, grace: float, lock: str | None, pulse: Heartbeat | None) -> list[str]:
        """:meth:`sweep_chunks` under ``lock`` kept by ``pulse`` (both None for a dry run)."""
        dry_run = pulse is None
        started = time.time()
        leases = self.chunks.leases()
        alive = {name for name, mtime in leases.items()
                 if name != lock and self.chunks.alive(name, mtime, started, grace)}
        if any(name.startswith("save-") for name in alive):
            self._unswept = self._unswept or not dry_run  # blocked: sweep again later
            return []  # a save may be about to name any chunk: sweep another time
        if not dry_run:
            for name in leases.keys() - alive - {lock}:  # of killed saves and sweeps
                best_effort(lambda name=name: self.chunks.remove_lease(name))  # type: ignore[misc]
            for relative, mtime in self.chunks.temp_files().items():  # of killed writes (local disk)
                if not fresh(mtime, started, grace):
                    best_effort(self.chunks.root.child(relative).remove)
        referenced = self._referenced()
        if referenced is None:
            self._unswept = self._unswept or not dry_run
            return []  # never guess what an unreadable manifest names
        now = time.time()
        unreferenced = {key: mtime for key, mtime in sorted(self.chunks.listing().items()) if key not in referenced}
        doomed = [key for key, mtime in unreferenced.items()
                  if grace == 0 or (mtime is not None and now - mtime >= grace)]
        if not dry_run:
            self._unswept = len(doomed) < len(unreferenced)  # young ones wait for a later sweep
        if pulse is None or not doomed:
            return [self.chunks.uri(key) for key in doomed]
        if not self._may_remove(pulse, None, 0, len(doomed)):
            return []
        self.chunks.bump_epoch()  # before the first removal: a save in flight then fails, or lists the store
        own = self.chunks.read_epoch()
        # What this manager knows stored holds for the epoch it last listed at, and another manager's sweep may have
        # moved the epoch and removed chunks since: were the new epoch taken as the one it listed at, its next save
        # would name such a chunk without uploading it. So that save lists the store again.
        self.chunks.epoch = None
        # A save that committed before the epoch moved, after the manifests were read above, names chunks
        # this sweep must keep: read the manifests again.
        again = self._referenced()
        if again is None:
            self._unswept = True
            return []
        doomed = [key for key in doomed if key not in again]
        removed = []
        for index, key in enumerate(doomed):
            if grace > 0 and time.time() - started > grace / 2:
                self._unswept = True
                break  # a live sweep holds saves back for no longer: a later sweep removes the rest
            if not self._may_remove(pulse, own if index % REMOVAL_BATCH == 0 else None, index, len(doomed)):
                break
            self.chunks.location(key).remove()
            if self.chunks.known is not None:
                self.chunks.known.discard(key)
            removed.append(self.chunks.uri(key))
            self.chunks.root.child(f"chunks/{key[:2]}").remove_empty_folder()
        return removed

    def _may_remove(self, pulse: Heartbeat, own: bytes | None, done: int, total: int) -> bool:
        """Whether the sweep may remove its next chunk: its heartbeat is current and (when ``own`` is given) the
        epoch is still the one it wrote. Otherwise a save may have taken it for dead: it stops, saying so."""
        why = ("its lock was not renewed for too long (the process was paused, or the store refused renewals)"
               if not pulse.current() else
               "a save took it for dead and rewrote the chunk epoch" if own is not None and
               self.chunks.read_epoch() != own else None)
        if why is None:
            return True
        self._unswept = True
        _log.logger.warning("the sweep of the chunks of %s stops after removing %d of %d: %s; a later sweep "
                            "removes the rest", _log.safe_uri(self.steps.directory), done, total, why)
        return False

    def _referenced(self) -> set[str] | None:
        """Every chunk that a committed manifest names, from a fresh listing of the steps; None when a manifest
        cannot be read (what it names is unknown)."""
        referenced: set[str] = set()
        for step, folder in sorted(self.steps.scan().items()):
            if not folder.committed:
                continue
            try:
                manifest = self.steps.manifest(step)
                referenced |= set() if manifest is None else self.steps.named(step, manifest).chunks.keys()
            except (CheckpointCorruptError, FileNotFoundError):
                _log.logger.warning("the manifest of step %d in %s is damaged: no chunk is removed until it is "
                                    "repaired or the step deleted", step, _log.safe_uri(self.steps.directory))
                return None
        return referenced


def deduplicable(payload: Payload) -> bool:
    return payload.kind in KINDS and isinstance(payload, (BytesPayload, DirectoryPayload))

