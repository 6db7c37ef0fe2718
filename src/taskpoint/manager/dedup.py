"""Deduplicated steps: a step's files cut into fixed-size chunks, each stored once in the directory's chunk store.

A save walks the payload (a directory; bytes and single files are one-file trees), hashes every chunk,
uploads in parallel only the chunks the store does not hold, and returns the tree that the step's manifest
records. A file unchanged since the last save of this manager read it (judged by ``lstat``, as
:mod:`.snapshots` explains) is not read again: its chunk list is that save's, once every chunk in it is known
to be stored. Restores are :mod:`.rebuild`'s. :meth:`Dedup.collect` removes the chunks that no manifest names.

Why a save never commits a step naming a deleted chunk is argued in docs/manager.md: a save writes its lease
before it decides which chunks are stored and removes it only after its manifest; a sweep writes its lock
before it lists the leases, removes nothing while a fresh save lease exists, and rewrites the epoch before
its first removal, which a save that waited for it reads before trusting what it listed.
Both write before they list, so of a save and a sweep that overlap, at least one sees the other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError, CheckpointError
from ..format.records import ChunkedTree
from ..payloads import BytesPayload, DirectoryPayload, Payload
from .chunks import ChunkStore, source_tree
from .snapshots import ReadIndex, Snapshot, trust_lstat
from .steps import StepStore, quietly

#: Size of a chunk: 4 MiB (see docs/manager.md for why fixed-size chunks, and why this size).
CHUNK_SIZE = 4 << 20
#: Chunks hashed, compressed and uploaded (or fetched and written) at once.
WORKERS = 8
#: How often a save waiting for a sweep looks again (seconds).
POLL = 0.2
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


#: How much earlier than its write a modification time listed in whole seconds may be: S3 lists
#: ``LastModified`` so (AWS, moto and SeaweedFS alike), and a lease written at 10.9 s is listed as written at 10 s.
MTIME_RESOLUTION = 1.0


def _fresh(mtime: float | None, now: float, grace: float) -> bool:
    """Whether a lease or lock written at ``mtime`` still counts (with ``grace`` 0, none does). A time in whole
    seconds is taken as truncated: up to :data:`MTIME_RESOLUTION` early."""
    if grace <= 0:
        return False
    if mtime is None:
        return True
    return now - mtime < grace + (MTIME_RESOLUTION if mtime == int(mtime) else 0.0)


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
        self._renewed = 0.0  # when the lease of the save in flight was last written
        self._reads = ReadIndex()  # what the last save read from each file
        #: The figures of the last deduplicated save.
        self.last: SaveStats | None = None
        self._swept_deleted = 0  # steps.deleted at the last sweep of a save
        self._swept_at = 0.0
        self._unswept = False  # the last sweep left unreferenced chunks (younger than the grace, or blocked)

    # -- the save's lease ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self) -> Iterator[None]:
        """Hold a save lease for the block: written first, kept fresh, removed after the block (the commit)."""
        name = self.chunks.new_lease("save")
        self._renewed = time.time()
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(self.grace / 4):
                renewing = time.time()
                with contextlib.suppress(Exception):  # a lease left unrenewed fails the save before its commit
                    self.chunks.write_lease(name)
                    self._renewed = renewing

        beat = threading.Thread(target=heartbeat, name="taskpoint-lease", daemon=True) if self.grace > 0 else None
        if beat is not None:
            beat.start()
        try:
            self._wait_for_sweeps()
            epoch = self.chunks.read_epoch()
            if self.chunks.known is None or epoch != self.chunks.epoch:
                self.chunks.known = set(self.chunks.listing())  # a sweep removed chunks: list the store again
                self.chunks.epoch = epoch
            yield
        finally:
            stop.set()
            if beat is not None:
                beat.join()
            quietly(lambda: self.chunks.remove_lease(name))

    def _wait_for_sweeps(self) -> None:
        while True:
            now = time.time()
            if not any(name.startswith("gc-") and _fresh(mtime, now, self.grace)
                       for name, mtime in self.chunks.leases().items()):
                return
            time.sleep(POLL)

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
        self.last = stats
        if reads is not None:
            reads.commit()
        if self.grace > 0 and time.time() - self._renewed > self.grace / 2:
            # A sweep may have taken the lease for a dead save's and removed chunks this step names.
            raise CheckpointError(f"a save to {self.steps.directory} could not renew its lease for "
                                  f"{time.time() - self._renewed:.0f} s (the grace is {self.grace:g} s); nothing was "
                                  "committed. Save again.")
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
        """The sweep of a save (after its commit): :meth:`collect` with the manager's grace."""
        self._swept_deleted, self._swept_at = self.steps.deleted, time.time()
        return self.collect(self.grace)

    def collect(self, grace: float, *, dry_run: bool = False) -> list[str]:
        """Remove the chunks that no committed manifest names, older than ``grace``, unless a save is in flight
        (a fresh save lease); return their URIs. Also removes leases older than ``grace`` (of killed saves)."""
        if not self.chunks.listing() and not self.chunks.leases() and not self.chunks.temp_files():
            return []
        lock = None if dry_run else self.chunks.new_lease("gc")
        started = time.time()
        try:
            leases = self.chunks.leases()
            if any(name.startswith("save-") and _fresh(mtime, started, grace) for name, mtime in leases.items()):
                self._unswept = self._unswept or not dry_run  # blocked: sweep again later
                return []  # a save may be about to name any chunk: sweep another time
            if not dry_run:
                for name, mtime in leases.items():  # of killed saves and sweeps
                    if name != lock and not _fresh(mtime, started, grace):
                        quietly(lambda name=name: self.chunks.remove_lease(name))  # type: ignore[misc]
                for relative, mtime in self.chunks.temp_files().items():  # of killed writes (local disk)
                    if not _fresh(mtime, started, grace):
                        quietly(self.chunks.root.child(relative).remove)
            referenced: set[str] = set()
            for step, folder in sorted(self.steps.scan().items()):
                if not folder.committed:
                    continue
                try:
                    manifest = self.steps.manifest(step)
                except CheckpointCorruptError:
                    self._unswept = self._unswept or not dry_run
                    return []  # never guess what an unreadable manifest names
                if manifest is not None and manifest.tree is not None:
                    referenced |= manifest.tree.chunk_keys()
            now = time.time()
            unreferenced = {key: mtime for key, mtime in sorted(self.chunks.listing().items()) if key not in referenced}
            doomed = [key for key, mtime in unreferenced.items()
                      if grace == 0 or (mtime is not None and now - mtime >= grace)]
            removed = [self.chunks.uri(key) for key in doomed]
            if not dry_run:
                self._unswept = len(doomed) < len(unreferenced)  # young ones wait for a later sweep
            if dry_run or not doomed:
                return removed
            self.chunks.bump_epoch()  # before the first removal: every save lists the store again
            self.chunks.epoch = self.chunks.read_epoch()
            removed = []
            for key in doomed:
                if grace > 0 and time.time() - started > grace / 2:
                    self._unswept = True
                    break  # saves stop waiting for this sweep once its lock is older than the grace
                self.chunks.location(key).remove()
                if self.chunks.known is not None:
                    self.chunks.known.discard(key)
                removed.append(self.chunks.uri(key))
                self.chunks.root.child(f"chunks/{key[:2]}").remove_empty_folder()
            return removed
        finally:
            if lock is not None:
                quietly(lambda: self.chunks.remove_lease(lock))


def deduplicable(payload: Payload) -> bool:
    return payload.kind in KINDS and isinstance(payload, (BytesPayload, DirectoryPayload))

