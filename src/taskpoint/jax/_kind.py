"""The ``jax.pytree`` step kind: a :class:`~taskpoint.jax.PyTree` saved into a manager step as the files Orbax
writes, committed and hashed in place, instead of a copy of them in a tar archive.

A step of this kind holds, in its folder::

    pytree-<save id>/            the folder :func:`~taskpoint.jax._pytree.write_tree` makes: the sidecar and
                                 Orbax's checkpoint of the arrays (``orbax/``), written there by Orbax itself
                                 when the store is the local disk, else uploaded file by file
    pytree-<save id>.files.json  taskpoint's file-set manifest: every file of that folder, its size and sha256
                                 (a file larger than 16 MiB: the BLAKE3 of each 16 MiB piece)
    taskpoint.json               the step's manifest, naming the folder and the file-set manifest's sha256

Why: an archive costs a second copy of every byte and one core of gzip on save and on restore (a 256 MiB tree
saved 1.45x and restored 2.2x Orbax's own time, issue 26); the files as Orbax wrote them cost one read to hash.
A restore reads every file against its digests before Orbax sees it: into the restore's folder, or (through
:func:`taskpoint.jax.load_pytree` on a local directory) in place. taskpoint.jax registers the kind on import and
names this module in the ``taskpoint.step_kinds`` entry points, so that any process reading such a step finds it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .._progress import Progress
from ..errors import CheckpointCorruptError
from ..format.fileset import PIECE_HASH, PIECE_SIZE, FileEntry, FileSetManifest, PieceHasher, file_hasher, piece_spans
from ..format.records import ObjectRecord, StepManifest
from ..manager.kind_api import (
    GONE_HOW,
    Checked,
    Described,
    Gone,
    SaveJob,
    StepContext,
    StepObjects,
    StepStore,
    Stored,
    best_effort,
    content_of,
    name_in,
    register_step_kind,
    stored_names,
)
from ..payloads import DirectoryPayload
from ..storage import WRITE_PIECE, Location, copy_fd_in_kernel, digest_by_reading
from ..workspace import Staging
from ._payload import PyTreePayload

#: The step kind's name in manifests.
KIND = "jax.pytree"
#: The format the file-set manifest names (what wrote the files).
FILES_KIND = "jax.orbax"
#: The codec the step's record names: files as Orbax wrote them, no archive.
FILES_CODEC = "files"
#: Files hashed, uploaded or restored at once.
WORKERS = 8
_FOLDER = re.compile(r"pytree-[0-9a-f]{32}")
_OWNED = stored_names(r"pytree-[0-9a-f]{32}[.]files[.]json")


@dataclass(frozen=True)
class PyTreeFiles:
    """The content of a PyTree step: the folder of the tree's files in the step's folder."""

    kind: ClassVar[str] = KIND
    folder: str

    @property
    def manifest(self) -> str:
        """The name of the file-set manifest that lists the folder's files."""
        return f"{self.folder}.files.json"

    def to_json(self) -> dict[str, Any]:
        return {"folder": self.folder}


def _tree_files(root: Path) -> dict[str, int]:
    """The regular files below ``root`` by relative ``/``-separated path, with their sizes."""
    found: dict[str, int] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            found[path.relative_to(root).as_posix()] = path.stat().st_size
    return found


def _hash_local(root: Path, plan: dict[str, tuple[int, str | None]], *, sync: bool = False,
                on_read: Callable[[int], None] | None = None) -> dict[str, FileEntry]:
    """The entries of files below ``root``, ``plan[rel] = (size, piece hash)``: a file listed by pieces is hashed
    piece by piece (by its piece hash) on all of :data:`WORKERS` threads at once (one large file is most of a
    tree), any other (piece hash None) by sha256, whole and one byte past ``size`` (a longer file then differs);
    an entry of size -1 for a missing file, which differs from any recorded. Each file is read through one open
    fd; with ``sync``, fsynced too (a commit is about to name it). ``on_read(n)`` is told of the bytes read."""
    fds: dict[str, int] = {}
    try:
        tasks: list[tuple[str, int, int]] = []
        for rel, (size, piece_hash) in plan.items():
            try:
                fds[rel] = os.open(root / rel, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            spans = piece_spans(size) if piece_hash is not None else [(0, size + 1)]
            tasks += [(rel, start, length) for start, length in spans]

        def hashed(task: tuple[str, int, int]) -> tuple[int, str]:
            rel, start, length = task
            hasher = file_hasher(plan[rel][1])
            count = digest_by_reading(fds[rel], length, hasher, start=start)
            if on_read is not None:
                on_read(count)
            return count, hasher.hexdigest()

        with concurrent.futures.ThreadPoolExecutor(min(WORKERS, max(1, len(tasks)))) as pool:
            done = list(pool.map(hashed, tasks))
            if sync:
                list(pool.map(os.fsync, fds.values()))
        found: dict[str, list[tuple[int, str]]] = {}
        for (rel, _, _), result in zip(tasks, done, strict=True):
            found.setdefault(rel, []).append(result)
        entries = {}
        for rel, (_, piece_hash) in plan.items():
            if rel not in fds:
                entries[rel] = FileEntry(-1, "")
            elif piece_hash is not None:
                entries[rel] = FileEntry.of_pieces(os.fstat(fds[rel]).st_size, [digest for _, digest in found[rel]],
                                                   piece_hash)
            else:
                entries[rel] = FileEntry(*found[rel][0])
        return entries
    finally:
        for fd in fds.values():
            os.close(fd)


def _hashes(listed: dict[str, FileEntry]) -> str:
    """The hashes a list's entries are checked by, for messages ("sha256", "sha256 and blake3")."""
    return " and ".join(sorted({entry.hash_name for entry in listed.values()}))


def _upload(path: Path, target: Location) -> FileEntry:
    """Upload the file at ``path`` to ``target``, hashing what it sends (by pieces when it is larger than one)."""
    size = path.stat().st_size
    hasher = PieceHasher(PIECE_HASH if size > PIECE_SIZE else None)
    with open(path, "rb") as source, target.open_write(size) as sink:
        while data := source.read(WRITE_PIECE):
            hasher.update(data)
            sink.write(data)
    return hasher.entry()


def _sync_folders(root: Path) -> None:
    for folder, _, _ in os.walk(root):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class PyTreeKind:
    """PyTrees in manager steps, as Orbax's files (see the module), saved by a blocking save in this process,
    where Orbax and jax live. A background save's snapshot is a tree serialized already, which this kind does
    not accept: it travels as a directory archive through the manager's save process (``helper``), which
    commits it even if this process dies first, and which never imports jax."""

    name = KIND
    helper = True

    def decode(self, body: dict[str, Any]) -> PyTreeFiles:
        return PyTreeFiles(name_in(body, "folder", _FOLDER, "a PyTree folder"))

    def accepts(self, payload: object, context: StepContext) -> bool:
        return isinstance(payload, PyTreePayload) and not payload.is_serialized

    # -- save ----------------------------------------------------------------------------------------------

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        """Write the tree's files into the step's folder (Orbax itself, on local disk), hash them, and write their
        file-set manifest, which the step's manifest names."""
        payload, steps, step = job.payload, context.steps, job.step
        assert isinstance(payload, PyTreePayload)
        save_id = uuid.uuid4().hex
        content = PyTreeFiles(f"pytree-{save_id}")
        tree = steps.object(step, content.folder)
        if tree.is_local:
            root = Path(tree.path)
            root.parent.mkdir(parents=True, exist_ok=True)
            payload.write_into(root)
        else:
            root = payload.serialized()
        sizes = _tree_files(root)
        job.progress.set_total(sum(sizes.values()))  # the bytes of the files Orbax wrote, each counted once stored
        if tree.is_local:
            plan = {rel: (size, PIECE_HASH if size > PIECE_SIZE else None) for rel, size in sizes.items()}
            entries = _hash_local(root, plan, sync=True, on_read=job.progress.update)
            _sync_folders(root)
        else:
            def stored(rel: str) -> FileEntry:
                entry = _upload(root / rel, tree.child(rel))
                job.progress.update(entry.size)
                return entry

            # Own pools here and below, not lanes of taskpoint.executors: each file's upload or download waits for
            # its parts or ranges on a lane of the IO pool, and waiting tasks on a shared bounded pool can deadlock
            # it.
            with concurrent.futures.ThreadPoolExecutor(min(WORKERS, max(1, len(sizes)))) as pool:
                entries = dict(zip(sizes, pool.map(stored, sizes), strict=True))
        files = FileSetManifest(kind=FILES_KIND, save_id=save_id, created=time.time(), files=entries,
                                attempt=job.attempt, metadata=job.metadata)
        data = files.to_bytes()
        steps.object(step, content.manifest).write_small(data, action="store the list of files of")
        record = ObjectRecord(kind=PyTreePayload.kind, codec=FILES_CODEC, save_id=save_id, created=time.time(),
                              size=len(data), sha256=hashlib.sha256(data).hexdigest())
        return Stored(content, record, {content.manifest: len(data),
                                        **{f"{content.folder}/{rel}": entry.size for rel, entry in entries.items()}},
                      sent=sum(entry.size for entry in entries.values()) + len(data))

    # -- reading -------------------------------------------------------------------------------------------

    def files(self, steps: StepStore, step: int, manifest: StepManifest) -> dict[str, FileEntry]:
        """The files of the step's tree by relative path, from its file-set manifest checked against the step's
        manifest. FileNotFoundError when that list is missing, CheckpointCorruptError when it is damaged."""
        content = content_of(manifest, PyTreeFiles)
        location = steps.object(step, content.manifest)
        data = location.read_small()
        if data is None:
            raise FileNotFoundError(f"its list of files {content.manifest} is missing")
        if (len(data), hashlib.sha256(data).hexdigest()) != (manifest.record.size, manifest.record.sha256):
            raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: its list of files "
                                         f"{content.manifest} does not match the sha256 of its manifest")
        return FileSetManifest.from_bytes(data, location.uri).files

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        """Copy the tree's files into ``workspace`` (replacing same-named entries), each checked against its
        digests before anything lands. :class:`Gone` when a file is missing."""
        steps, content = context.steps, content_of(manifest, PyTreeFiles)
        try:
            listed = self.files(steps, step, manifest)
        except FileNotFoundError:
            raise self._gone(steps, step, content.manifest) from None
        progress.set_total(sum(entry.size for entry in listed.values()))
        workspace.mkdir(parents=True, exist_ok=True)
        with Staging(workspace) as staging:
            def fetch(rel: str) -> None:
                self._fetch(steps, step, f"{content.folder}/{rel}", listed[rel], staging / rel, progress)

            with concurrent.futures.ThreadPoolExecutor(min(WORKERS, max(1, len(listed)))) as pool:
                for done in pool.map(fetch, listed):
                    del done
            return DirectoryPayload.publish(staging, workspace)

    def restore_in_place(self, context: StepContext, step: int, manifest: StepManifest, progress: Progress
                         ) -> Path | None:
        """The tree's folder in the step's own folder, for Orbax to read without a copy, once every file its list
        names has been read against its size and digests there (on :data:`WORKERS` threads, each through an open
        fd; the errors and messages of :meth:`restore`). None off local disk, and when the folder holds a file the
        list does not name: a restore's copy leaves such a file out, and so must what Orbax reads."""
        steps, content = context.steps, content_of(manifest, PyTreeFiles)
        tree = steps.object(step, content.folder)
        if not tree.is_local:
            return None
        try:
            listed = self.files(steps, step, manifest)
        except FileNotFoundError:
            raise self._gone(steps, step, content.manifest) from None
        root = Path(tree.path)
        if {Path(folder, name).relative_to(root).as_posix() for folder, _, names in os.walk(root)
                for name in names} - listed.keys():
            return None
        progress.set_total(sum(entry.size for entry in listed.values()))
        found = _hash_local(root, {rel: (entry.size, entry.piece_hash or None) for rel, entry in listed.items()},
                            on_read=progress.update)
        for rel, entry in sorted(listed.items()):
            if found[rel].size < 0:
                raise self._gone(steps, step, f"{content.folder}/{rel}")
            if found[rel] != entry:
                raise self._damaged(steps, step, f"{content.folder}/{rel}", entry, found[rel])
        return root

    def _fetch(self, steps: StepStore, step: int, name: str, entry: FileEntry, dest: Path, progress: Progress
               ) -> None:
        """Copy the stored file ``name`` to ``dest``, hashing it; on local disk it is hashed, then copied by the
        kernel (both read the same open file, which saves never write into once committed)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        hasher, source = PieceHasher(entry.piece_hash or None), steps.object(step, name)
        try:
            with source.open_read(entry.size) as raw, open(dest, "xb") as out:
                if source.is_local:
                    size = digest_by_reading(raw.fileno(), entry.size + 1, hasher)
                    if copy_fd_in_kernel(raw.fileno(), out.fileno(), size) != size:
                        raise CheckpointCorruptError(f"{source.uri} changed while it was being restored; restore "
                                                     "it again")
                    progress.update(size)
                else:
                    while data := raw.read(WRITE_PIECE):
                        hasher.update(data)
                        out.write(data)
                        progress.update(len(data))
        except FileNotFoundError:
            raise self._gone(steps, step, name) from None
        found = hasher.entry()
        if found != entry:
            raise self._damaged(steps, step, name, entry, found)

    @staticmethod
    def _gone(steps: StepStore, step: int, name: str) -> Gone:
        return Gone(f"step {step} in {steps.directory} is committed but its file {name} is missing: it was removed "
                    f"after the commit{GONE_HOW}. Restore an older step (fallback=True), or delete this one.")

    @staticmethod
    def _damaged(steps: StepStore, step: int, name: str, entry: FileEntry, found: FileEntry
                 ) -> CheckpointCorruptError:
        where = next((f" (piece {index}, from byte {index * PIECE_SIZE})" for index, (a, b)
                      in enumerate(zip(entry.pieces, found.pieces, strict=False)) if a != b), "")
        return CheckpointCorruptError(
            f"step {step} in {steps.directory} is damaged: read {found.size} bytes of {name} that do not match the "
            f"{entry.hash_name} of its manifest{where} (recorded size {entry.size}). Restore an older step "
            "(fallback=True), or save it again.")

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        steps, content = context.steps, content_of(manifest, PyTreeFiles)
        listed = self.files(steps, step, manifest)
        for rel, entry in sorted(listed.items()):
            name = f"{content.folder}/{rel}"
            try:
                with steps.object(step, name).open_read(entry.size) as source:
                    hasher = PieceHasher(entry.piece_hash or None)
                    while data := source.read(WRITE_PIECE):
                        hasher.update(data)
            except FileNotFoundError:
                raise FileNotFoundError(f"its file {name} is missing") from None
            found = hasher.entry()
            if found != entry:
                raise self._damaged(steps, step, name, entry, found)
        return Checked(sum(entry.size for entry in listed.values()),
                       f"{len(listed)} files, {_hashes(listed)} match its manifest")

    # -- listing and deleting ------------------------------------------------------------------------------

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        content = content_of(manifest, PyTreeFiles)
        listed = self.files(steps, step, manifest)
        return StepObjects(files={content.manifest: manifest.record.size,
                                  **{f"{content.folder}/{rel}": entry.size for rel, entry in listed.items()}},
                           noun="file")

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        """The tree's folder, whole, then the list of its files. A list it cannot read leaves them to the sweep
        of uncommitted folders."""
        content = content_of(manifest, PyTreeFiles)
        tree = steps.object(step, content.folder)
        try:
            listed = self.files(steps, step, manifest)
        except (CheckpointCorruptError, FileNotFoundError):
            return set()
        del listed  # read only to tell a step whose list is readable
        best_effort(tree.remove_tree)
        best_effort(steps.object(step, content.manifest).remove)
        return {content.manifest}

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        listed = self.files(context.steps, step, manifest)
        return Described(payload=content_of(manifest, PyTreeFiles).manifest, details={
            "size": sum(entry.size for entry in listed.values()), "payload_size": manifest.record.size,
            "files": len(listed)})

    def owns(self, name: str, committed: bool) -> bool:
        # A tree's folder is swept only from a folder no manifest commits: a committed step's is named by its
        # manifest, or was replaced by an overwrite, whose commit removed the files the old manifest named.
        return bool(_OWNED.fullmatch(name)) or (not committed and bool(_FOLDER.fullmatch(name)))


def lost_in_place(folder: Path) -> bool:
    """Whether ``folder`` is a tree's folder inside a step (what :meth:`PyTreeKind.restore_in_place` returns)
    that no longer holds every file its list names at its size: another process overwrote or deleted the step
    while it was read there. False for any other folder (a restore's copy, which nobody else changes)."""
    if not _FOLDER.fullmatch(folder.name):
        return False
    listing = folder.with_name(f"{folder.name}.files.json")
    try:
        listed = FileSetManifest.from_bytes(listing.read_bytes(), str(listing)).files
        return any((folder / rel).stat().st_size != entry.size for rel, entry in listed.items())
    except (OSError, ValueError, CheckpointCorruptError):
        return True


PYTREE = register_step_kind(PyTreeKind())
