"""Restoring a deduplicated step: its tree rebuilt in a staging folder from chunks fetched in parallel, each
verified against its name, then published the way the payload kind publishes (see :mod:`.dedup` for saving)."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from pathlib import Path

from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError
from ..format.archive import link_leaves
from ..format.space import check_room
from ..format.tree import ChunkedTree, TreeEntry
from ..payloads import payload_class
from ..signals import uninterrupted
from ..workspace import Staging
from .chunks import ChunkStore
from .steps import StepStore


class MissingChunk(Exception):
    """A chunk a step names is not in the store (the caller decides whether the step changed meanwhile)."""

    def __init__(self, path: str, uri: str) -> None:
        super().__init__(f"file {path!r} needs chunk {uri}, which is missing")
        self.path = path


class Rebuilder:
    """Rebuilds the trees of the deduplicated steps of one manager directory."""

    def __init__(self, steps: StepStore, chunks: ChunkStore, workers: int) -> None:
        self.steps = steps
        self.chunks = chunks
        self.workers = workers

    def restore(self, step: int, tree: ChunkedTree, kind: str, workspace: Path, progress: Progress = NO_PROGRESS
                ) -> Path:
        """Rebuild ``step``'s ``tree`` in a staging folder of ``workspace``, every chunk verified, then publish
        it as the payload kind ``kind`` does. MissingChunk when a chunk is not stored; CheckpointCorruptError
        names the step and the file when one does not match. ``progress`` counts the plain bytes of the files."""
        cls = payload_class(kind, self.steps.step_uri(step))
        workspace.mkdir(parents=True, exist_ok=True)
        with Staging(workspace) as staging:
            self._rebuild(step, tree, staging, progress)
            with uninterrupted():  # a signal waits until every entry has landed
                return cls.publish(staging, workspace)

    def verify(self, step: int, tree: ChunkedTree, progress: Progress = NO_PROGRESS) -> int:
        """Fetch and check every chunk of ``step``'s ``tree`` as :meth:`restore` does, writing nothing; the plain
        bytes of its files. MissingChunk and CheckpointCorruptError as there."""
        self._check_tree(step, tree)
        total = tree.file_bytes()
        progress.set_total(total)
        self._fetch_all(step, tree, progress, lambda entry, offset, data: None)
        return total

    def _damaged(self, step: int, path: str, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"step {step} in {self.steps.directory}: file {path!r} is damaged: {why}. "
                                      "Restore an older step (fallback=True), or save it again.")

    def _check_tree(self, step: int, tree: ChunkedTree) -> None:
        """Refuse a manifest whose tree could write outside the staging folder or does not add up."""
        seen: dict[str, str] = {}
        for entry in tree.entries:
            parts = entry.path.split("/")
            if entry.path in seen or any(p in ("", ".", "..") for p in parts) or "\\" in entry.path:
                raise self._damaged(step, entry.path, "its manifest names an unsafe or repeated path")
            if entry.type == "link" and link_leaves(len(parts) - 1, entry.target or ""):
                raise self._damaged(step, entry.path, f"symlink {entry.target!r} leads outside")
            expected = -(-entry.size // tree.chunk_size) if entry.type == "file" else 0
            if len(entry.chunks) != expected:
                raise self._damaged(step, entry.path, "its manifest lists the wrong number of chunks")
            seen[entry.path] = entry.type
            for i in range(1, len(parts)):
                if seen.get("/".join(parts[:i]), "dir") != "dir":
                    raise self._damaged(step, entry.path, "it lies below an entry that is not a folder")

    def _rebuild(self, step: int, tree: ChunkedTree, staging: Path, progress: Progress) -> None:
        self._check_tree(step, tree)
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
        progress.set_total(tree.file_bytes())

        def write(entry: TreeEntry, offset: int, data: bytes) -> None:
            fd = os.open(staging / entry.path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        self._fetch_all(step, tree, progress, write)
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

    def _fetch_all(self, step: int, tree: ChunkedTree, progress: Progress,
                   write: Callable[[TreeEntry, int, bytes], None]) -> None:
        """Fetch every chunk on the pool, each verified, and hand it to ``write(entry, offset, data)``."""
        def fetch(entry: TreeEntry, index: int, key: str) -> None:
            offset = index * tree.chunk_size
            length = min(tree.chunk_size, entry.size - offset)
            try:
                data = self.chunks.get(key, length)
            except FileNotFoundError:
                raise MissingChunk(entry.path, self.chunks.uri(key)) from None
            except CheckpointCorruptError as exc:
                raise self._damaged(step, entry.path, str(exc)) from exc
            write(entry, offset, data)
            progress.update(length)

        slots = threading.BoundedSemaphore(2 * self.workers)  # chunks in memory at once
        failed = threading.Event()

        def done(future: concurrent.futures.Future[None]) -> None:
            if future.exception() is not None:
                failed.set()
            slots.release()

        # Its own pool, not a lane of taskpoint.executors: a chunk's read goes through the store's backend, which
        # may read it on a lane of the IO pool and wait, and waiting tasks on a shared bounded pool can deadlock it.
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
