"""Deduplicated steps: a step's files cut into fixed-size chunks, each stored once in the directory's chunk store.

A save walks the payload (a directory; bytes and single files are one-file trees), hashes every chunk,
uploads in parallel only the chunks the store does not hold, and returns the tree that the step's manifest
records. A file unchanged since the last save of this manager read it (judged by ``lstat``, as
:mod:`.snapshots` explains) is not read again: its chunk list is that save's, once every chunk in it is known
to be stored. A restore fetches the chunks in parallel, verifies each against its name, and rebuilds the tree in a
staging folder. :meth:`Dedup.collect` removes the chunks that no manifest names.

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
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError, CheckpointError
from ..format.records import ChunkedTree, StepManifest, TreeEntry
from ..format.space import check_room
from ..payloads import BytesPayload, DirectoryPayload, Payload, payload_class
from ..workspace import STAGING_PREFIX
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


def _fresh(mtime: float | None, now: float, grace: float) -> bool:
    """Whether a lease or lock written at ``mtime`` still counts (with ``grace`` 0, none does)."""
    return grace > 0 and (mtime is None or now - mtime < grace)


class MissingChunk(Exception):
    """A chunk a step names is not in the store (the caller decides whether the step changed meanwhile)."""

    def __init__(self, path: str, uri: str) -> None:
        super().__init__(f"file {path!r} needs chunk {uri}, which is missing")
        self.path = path


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

    # -- restoring -----------------------------------------------------------------------------------------

    def restore(self, step: int, manifest: StepManifest, workspace: Path, progress: Progress = NO_PROGRESS
                ) -> Path:
        """Rebuild ``manifest``'s tree in a staging folder of ``workspace``, every chunk verified, then publish
        it as the payload kind does. MissingChunk when a chunk is not stored; CheckpointCorruptError names the
        step and the file when one does not match. ``progress`` counts the plain bytes of the files."""
        tree = manifest.tree
        assert tree is not None
        cls = payload_class(manifest.record.kind, self.steps.step_uri(step))
        workspace.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=workspace))
        try:
            self._rebuild(step, tree, staging, progress)
            return cls.publish(staging, workspace)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _damaged(self, step: int, path: str, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"step {step} in {self.steps.directory}: file {path!r} is damaged: {why}. "
                                      "Restore an older step (fallback=True), or save it again.")

    def _rebuild(self, step: int, tree: ChunkedTree, staging: Path, progress: Progress) -> None:
        seen: dict[str, str] = {}
        for entry in tree.entries:
            parts = entry.path.split("/")
            if entry.path in seen or any(p in ("", ".", "..") for p in parts) or "\\" in entry.path:
                raise self._damaged(step, entry.path, "its manifest names an unsafe or repeated path")
            if entry.type == "link":
                depth = len(parts) - 1
                for piece in (entry.target or "").split("/"):
                    depth += -1 if piece == ".." else 0 if piece in ("", ".") else 1
                    if depth < 0:
                        break
                if not entry.target or entry.target.startswith("/") or depth < 0:
                    raise self._damaged(step, entry.path, f"symlink {entry.target!r} leads outside")
            expected = -(-entry.size // tree.chunk_size) if entry.type == "file" else 0
            if len(entry.chunks) != expected:
                raise self._damaged(step, entry.path, "its manifest lists the wrong number of chunks")
            seen[entry.path] = entry.type
            for i in range(1, len(parts)):
                if seen.get("/".join(parts[:i]), "dir") != "dir":
                    raise self._damaged(step, entry.path, "it lies below an entry that is not a folder")
        check_room(staging, sum(e.size for e in tree.entries), self.steps.step_uri(step))
        # Folders and empty files first; links last, so that nothing is ever written through one.
        for entry in tree.entries:
            target = staging / entry.path
            if entry.type == "dir":
                target.mkdir(parents=True, exist_ok=True)
            elif entry.type == "file":
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if entry.mode
                             is not None else 0o666)
                try:
                    os.ftruncate(fd, entry.size)
                finally:
                    os.close(fd)
        progress.set_total(sum(e.size for e in tree.entries if e.type == "file"))
        self._fetch_all(step, tree, staging, progress)
        for entry in tree.entries:
            target = staging / entry.path
            if entry.type == "file":
                if entry.mode is not None:
                    os.chmod(target, entry.mode)
                if entry.mtime is not None:
                    os.utime(target, (entry.mtime, entry.mtime))
            elif entry.type == "link":
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(entry.target or "", target)
        for entry in reversed(tree.entries):  # deepest first, so that a read-only folder could be filled
            if entry.type == "dir":
                target = staging / entry.path
                if entry.mode is not None:
                    os.chmod(target, entry.mode)
                if entry.mtime is not None:
                    os.utime(target, (entry.mtime, entry.mtime))

    def _fetch_all(self, step: int, tree: ChunkedTree, staging: Path, progress: Progress) -> None:
        def fetch(entry: TreeEntry, index: int, key: str) -> None:
            offset = index * tree.chunk_size
            length = min(tree.chunk_size, entry.size - offset)
            try:
                data = self.chunks.get(key, length)
            except FileNotFoundError:
                raise MissingChunk(entry.path, self.chunks.uri(key)) from None
            except CheckpointCorruptError as exc:
                raise self._damaged(step, entry.path, str(exc)) from exc
            fd = os.open(staging / entry.path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
            progress.update(length)

        slots = threading.BoundedSemaphore(2 * self.workers)  # chunks in memory at once
        failed = threading.Event()

        def done(future: concurrent.futures.Future[None]) -> None:
            if future.exception() is not None:
                failed.set()
            slots.release()

        with concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="taskpoint-chunk") as pool:
            futures = []
            for entry in tree.entries:
                for index, key in enumerate(entry.chunks):
                    slots.acquire()
                    if failed.is_set():
                        slots.release()
                        break
                    futures.append(pool.submit(fetch, entry, index, key))
                    futures[-1].add_done_callback(done)
            for future in futures:
                future.result()

    # -- collecting unreferenced chunks --------------------------------------------------------------------

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
                    return []  # never guess what an unreadable manifest names
                if manifest is not None and manifest.tree is not None:
                    referenced |= manifest.tree.chunk_keys()
            now = time.time()
            doomed = [key for key, mtime in sorted(self.chunks.listing().items()) if key not in referenced
                      and (grace == 0 or (mtime is not None and now - mtime >= grace))]
            removed = [self.chunks.uri(key) for key in doomed]
            if dry_run or not doomed:
                return removed
            self.chunks.bump_epoch()  # before the first removal: every save lists the store again
            self.chunks.epoch = self.chunks.read_epoch()
            removed = []
            for key in doomed:
                if grace > 0 and time.time() - started > grace / 2:
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

