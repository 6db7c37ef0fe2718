"""The core's kind of files: a step that is a set of files, each listed with its size and digests (the sha256 of
a file, or the BLAKE3 of each 16 MiB piece of one larger than a piece) by a file-set manifest
(:class:`~taskpoint.format.fileset.FileSetManifest`), which the step's manifest names by size and sha256.

The extras' ``jax.pytree`` (the folder Orbax writes), ``fileset`` (DCP's files) and ``torch.state_dict`` (one
``torch.save`` file, which the step's manifest lists itself) subclass :class:`FilesKind` under the names their
steps have always had, and keep only how their objects become files and back; it stores, restores (a verified
copy, or in place), reads (:meth:`FilesKind.reader`), verifies, lists, describes and deletes the files once for
all. Their steps are written byte for byte as before, so every taskpoint that read them still does
(docs/format.md, "One kind of file sets, under the names already written"). Every file is read against its
digests before its bytes are used, by the one piece engine (:mod:`taskpoint.pieces`): on local disk through one
open fd per file, hashed by pieces on :data:`~taskpoint.pieces.LOCAL_WORKERS` threads (one large file is most of
a tree), then copied by the kernel from that fd; elsewhere streamed through a ``PieceHasher``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

from ... import _progress
from ..._progress import Progress
from ...errors import CheckpointCorruptError
from ...format.fileset import PIECE_HASH, PIECE_SIZE, FileEntry, FileSetManifest, PieceHasher
from ...format.pieces import entry_damage
from ...format.records import ObjectRecord, StepContent, StepManifest
from ...payloads import DirectoryPayload
from ...pieces import HashPlan, PieceReader, hash_local
from ...storage import WRITE_PIECE, Location, copy_fd_in_kernel, digest_by_reading
from ...workspace import Staging
from ..step_commit import Stored
from ..steps import StepObjects, StepStore, best_effort
from . import GONE_HOW, Checked, Described, Gone, SaveJob, StepContext

#: Files uploaded, restored or streamed at once.
WORKERS = 8


class FilesContent(StepContent, Protocol):
    """The content of a step of files: the folder of its files in the step's folder ("": the step's folder
    itself) and the name of the file-set manifest that lists them."""

    @property
    def folder(self) -> str: ...

    @property
    def manifest(self) -> str: ...


class FolderSource(Protocol):
    """What becomes a folder of files (a PyTree, through Orbax): written straight into a folder on local disk,
    or into a temp folder of its own, whose files are then uploaded."""

    def write_into(self, folder: Path) -> None: ...

    def serialized(self) -> Path: ...


def stored_name(content: FilesContent, rel: str) -> str:
    """The name in the step's folder of the file ``rel`` of the set."""
    return f"{content.folder}/{rel}" if content.folder else rel


def _content(manifest: StepManifest) -> FilesContent:
    """The manifest's content, of a kind of files (a kind is handed only the manifests that name it)."""
    return cast(FilesContent, manifest.content)


def _folder(steps: StepStore, step: int, content: FilesContent) -> Location:
    """The folder of the files in the step's folder."""
    return steps.object(step, content.folder) if content.folder else steps.folder(step)


class _Missing(FileNotFoundError):
    """A file of the step (``what``: or their list) is missing: what a verification raises, and a restore turns
    into :class:`Gone`."""

    def __init__(self, name: str, what: str = "file") -> None:
        super().__init__(f"its {what} {name} is missing")
        self.name = name


def _on_threads(work: Callable[[str], Any], names: Iterable[str]) -> list[Any]:
    """``work`` of each name on up to :data:`WORKERS` threads of a pool of its own, not lanes of
    :mod:`taskpoint.executors`: each file's upload or download waits for its parts or ranges on a lane of the IO
    pool, and waiting tasks on a shared bounded pool can deadlock it."""
    names = list(names)
    with concurrent.futures.ThreadPoolExecutor(min(WORKERS, max(1, len(names)))) as pool:
        return list(pool.map(work, names))


def _plan(size: int) -> HashPlan:
    """How a new file of ``size`` bytes is hashed: by BLAKE3 pieces above one piece, else by one sha256."""
    return size, PIECE_HASH if size > PIECE_SIZE else None, PIECE_SIZE


def _upload(path: Path, target: Location) -> FileEntry:
    """Upload the file at ``path`` to ``target``, hashing what it sends (by pieces when it is larger than one)."""
    size = path.stat().st_size
    hasher = PieceHasher(_plan(size)[1])
    with open(path, "rb") as source, target.open_write(size) as sink:
        while data := source.read(WRITE_PIECE):
            hasher.update(data)
            sink.write(data)
    return hasher.entry()


def _local_files(root: Path) -> list[str]:
    """The files below ``root`` by relative ``/``-separated path."""
    return [Path(folder, name).relative_to(root).as_posix() for folder, _, names in os.walk(root) for name in names]


def _sync_folders(root: Path) -> None:
    for folder, _, _ in os.walk(root):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def store_folder(context: StepContext, job: SaveJob, folder: str, source: FolderSource) -> dict[str, FileEntry]:
    """Store ``source``'s files as the folder ``folder`` of the step's folder, and list them
    (:func:`write_folder`)."""
    return write_folder(context.steps.object(job.step, folder), source, job.progress)


def write_folder(tree: Location, source: FolderSource, progress: Progress) -> dict[str, FileEntry]:
    """Store ``source``'s files as the folder ``tree`` (of a step: a blocking save's, or the save process's write of
    a staged one), and list them: on local disk written there directly, then hashed and fsynced; elsewhere written
    into ``source``'s own temp folder and uploaded file by file, hashed as they go. ``progress`` counts the bytes of
    the files, each once stored."""
    if tree.is_local:
        root = Path(tree.path)
        root.parent.mkdir(parents=True, exist_ok=True)
        source.write_into(root)
    else:
        root = source.serialized()
    sizes = {rel: (root / rel).stat().st_size for rel in _local_files(root)}
    progress.set_total(sum(sizes.values()))
    if tree.is_local:
        entries = hash_local(root, {rel: _plan(size) for rel, size in sizes.items()}, sync=True,
                             on_read=progress.update)
        _sync_folders(root)
        return entries

    def stored(rel: str) -> FileEntry:
        entry = _upload(root / rel, tree.child(rel))
        progress.update(entry.size)
        return entry

    return dict(zip(sizes, _on_threads(stored, sizes), strict=True))


def stored_files(content: FilesContent, listing: bytes, files: dict[str, FileEntry], kind: str, codec: str,
                 save_id: str, sent: int = 0) -> Stored:
    """What a step of files stored, for the commit: ``content``, whose file-set manifest (``listing``, stored)
    lists ``files``, and a record of that manifest by size and sha256 (``kind``, ``codec``: what the record
    names)."""
    record = ObjectRecord(kind=kind, codec=codec, save_id=save_id, created=time.time(), size=len(listing),
                          sha256=hashlib.sha256(listing).hexdigest())
    return Stored(content, record, {content.manifest: len(listing),
                                    **{stored_name(content, rel): entry.size for rel, entry in files.items()}},
                  sent=sent)


def store_listing(context: StepContext, job: SaveJob, content: FilesContent, files: dict[str, FileEntry],
                  writer: str, save_id: str, kind: str, codec: str) -> Stored:
    """Write the file-set manifest of ``files`` into the step's folder with the job's attempt and metadata, and say
    what was stored (:func:`write_listing`)."""
    return write_listing(context.steps.object(job.step, content.manifest), content, files, writer, save_id, kind,
                         codec, job.attempt, job.metadata)


def write_listing(location: Location, content: FilesContent, files: dict[str, FileEntry], writer: str, save_id: str,
                  kind: str, codec: str, attempt: int | None, metadata: dict[str, Any]) -> Stored:
    """Write the file-set manifest of ``files`` (``writer``: the format that wrote them, the manifest's kind) at
    ``location``, ``content``'s manifest in the step's folder, and say what was stored (:func:`stored_files`)."""
    data = FileSetManifest(kind=writer, save_id=save_id, created=time.time(), files=files, attempt=attempt,
                           metadata=metadata).to_bytes()
    location.write_small(data, action="store the list of files of")
    sent = sum(entry.size for entry in files.values()) + len(data)
    return stored_files(content, data, files, kind, codec, save_id, sent)


class FilesKind:
    """A step kind of files (see the module). A subclass says how its objects become files (``store``, with
    :func:`store_folder` and :func:`store_listing`, or :func:`stored_files` for files another writer stored),
    its ``name``, ``helper``, ``decode``, ``accepts`` and ``owns``; its content follows :class:`FilesContent`.
    A kind whose step manifest lists its files itself (a state dict's one file) says so in :meth:`files` and
    :meth:`listing`."""

    def listing(self, manifest: StepManifest) -> dict[str, int | None]:
        """The objects that list the step's files, by name and the size its manifest records: its file-set
        manifest."""
        return {_content(manifest).manifest: manifest.record.size}

    def restored_as(self, rel: str) -> str:
        """The name in a restore's folder of the file ``rel``: its own."""
        return rel

    def files(self, steps: StepStore, step: int, manifest: StepManifest) -> dict[str, FileEntry]:
        """The files of the step by relative path, from its file-set manifest checked against the step's
        manifest. FileNotFoundError when that list is missing, CheckpointCorruptError when it is damaged."""
        name = _content(manifest).manifest
        location = steps.object(step, name)
        data = location.read_small()
        if data is None:
            raise _Missing(name, "list of files")
        if (len(data), hashlib.sha256(data).hexdigest()) != (manifest.record.size, manifest.record.sha256):
            raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: its list of files {name} "
                                         "does not match the sha256 of its manifest")
        return FileSetManifest.from_bytes(data, location.uri).files

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        """Copy the files into ``workspace`` (replacing same-named entries), each checked against its digests
        before anything lands. :class:`Gone` when a file (or their list) is missing."""
        steps, content = context.steps, _content(manifest)
        with _restoring(steps, step):
            listed = self.files(steps, step, manifest)
            progress.set_total(sum(entry.size for entry in listed.values()))
            workspace.mkdir(parents=True, exist_ok=True)
            with Staging(workspace) as staging:
                _on_threads(lambda rel: _fetch(steps, step, stored_name(content, rel), listed[rel],
                                               staging / self.restored_as(rel), progress), listed)
                return DirectoryPayload.publish(staging, workspace)

    def restore_in_place(self, context: StepContext, step: int, manifest: StepManifest, progress: Progress
                         ) -> Path | None:
        """The folder of the files in the step's own folder, to be read without a copy, once every file its list
        names has been read against its size and digests there (the errors and messages of :meth:`restore`).
        None off local disk, and when the folder holds a file the list does not name: a restore's copy leaves
        such a file out, and so must what is read in place."""
        steps, content = context.steps, _content(manifest)
        folder = _folder(steps, step, content)
        if not folder.is_local:
            return None
        root = Path(folder.path)
        with _restoring(steps, step):
            listed = self.files(steps, step, manifest)
            if set(_local_files(root)) - listed.keys():
                return None
            progress.set_total(sum(entry.size for entry in listed.values()))
            _check_local(steps, step, content, root, listed, progress.update)
        return root

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        """Every file read against its digests: on local disk by pieces on
        :data:`~taskpoint.pieces.LOCAL_WORKERS` threads, elsewhere streamed, :data:`WORKERS` files at once."""
        steps, content = context.steps, _content(manifest)
        listed, folder = self.files(steps, step, manifest), _folder(steps, step, content)
        size = sum(entry.size for entry in listed.values())
        with _progress.resolve(progress, f"verify step {step}") as tracker:
            tracker.set_total(size)
            if folder.is_local:
                _check_local(steps, step, content, Path(folder.path), listed, tracker.update)
            else:
                _on_threads(lambda rel: _fetch(steps, step, stored_name(content, rel), listed[rel], None, tracker),
                            listed)
        hashes = " and ".join(sorted({entry.hash_name for entry in listed.values()}))
        return Checked(size, f"{len(listed)} files, {hashes} match its manifest")

    def reader(self, context: StepContext, step: int, manifest: StepManifest, rel: str) -> PieceReader:
        """A reader of the file ``rel`` that checks each piece before it returns a byte of it (a file listed
        whole, before it returns any): on local disk from the open file, elsewhere by ranged reads.
        :class:`Gone` when it is missing; KeyError when the step lists no such file."""
        steps, content = context.steps, _content(manifest)
        entry, name = self.files(steps, step, manifest)[rel], stored_name(content, rel)
        source = steps.object(step, name)

        def damaged(index: int) -> CheckpointCorruptError:
            return _damaged(steps, step, name, entry, index)

        if source.is_local:
            try:
                fd = os.open(source.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise file_gone(steps, step, name) from None
            return PieceReader(entry, damaged, fd=fd, name=source.path)

        def fetch(start: int, length: int) -> bytes:
            try:
                return source.read_range(start, length)
            except FileNotFoundError:
                raise file_gone(steps, step, name) from None

        return PieceReader(entry, damaged, fetch=fetch)

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        content, listed = _content(manifest), self.files(steps, step, manifest)
        return StepObjects(files={**self.listing(manifest),
                                  **{stored_name(content, rel): entry.size for rel, entry in listed.items()}},
                           noun="file")

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        """The files (a folder of them, whole), then their list. A list it cannot read leaves them to the sweep
        of uncommitted folders."""
        content = _content(manifest)
        try:
            listed = self.files(steps, step, manifest)
        except (CheckpointCorruptError, FileNotFoundError):
            return set()
        names = {stored_name(content, rel) for rel in listed}
        if content.folder:
            best_effort(steps.object(step, content.folder).remove_tree)
        else:
            for name in names:
                best_effort(steps.object(step, name).remove)
        for name in self.listing(manifest):
            best_effort(steps.object(step, name).remove)
        return {*self.listing(manifest), *names}

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        # Its payload is the list of the files that hold its data: the size is theirs.
        listed = self.files(context.steps, step, manifest)
        return Described(payload=_content(manifest).manifest, details={
            "size": sum(entry.size for entry in listed.values()), "payload_size": manifest.record.size,
            "files": len(listed)})


@contextlib.contextmanager
def _restoring(steps: StepStore, step: int) -> Iterator[None]:
    """A missing file (or list of files) inside the block as :class:`Gone`, the error of a restore."""
    try:
        yield
    except _Missing as exc:
        raise file_gone(steps, step, exc.name) from None


def file_gone(steps: StepStore, step: int, name: str) -> Gone:
    """The error of a restore of ``step`` whose file ``name`` is missing."""
    return Gone(f"step {step} in {steps.directory} is committed but its file {name} is missing: it was removed "
                f"after the commit{GONE_HOW}. Restore an older step (fallback=True), or delete this one.")


def _check_local(steps: StepStore, step: int, content: FilesContent, root: Path, listed: dict[str, FileEntry],
                 on_read: Callable[[int], None]) -> None:
    """Hash the files below ``root`` (:func:`~taskpoint.pieces.hash_local`) and compare them with ``listed``."""
    found = hash_local(root, {rel: (entry.size, entry.piece_hash or None, entry.piece_size)
                              for rel, entry in listed.items()}, on_read=on_read)
    for rel, entry in sorted(listed.items()):
        if found[rel].size < 0:
            raise _Missing(stored_name(content, rel))
        if found[rel] != entry:
            raise _damaged(steps, step, stored_name(content, rel), entry, found[rel])


def _fetch(steps: StepStore, step: int, name: str, entry: FileEntry, dest: Path | None, progress: Progress) -> None:
    """Read the stored file ``name`` against ``entry``, copying it to ``dest`` (None: keeping nothing); on local
    disk it is hashed, then copied by the kernel (both read the same open file, which saves never write into once
    committed)."""
    if dest is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
    hasher, source = PieceHasher(entry.piece_hash or None, entry.piece_size), steps.object(step, name)
    try:
        with source.open_read(entry.size) as raw, \
                open(dest, "xb") if dest is not None else contextlib.nullcontext() as out:
            if source.is_local and out is not None:
                size = digest_by_reading(raw.fileno(), entry.size + 1, hasher)
                if copy_fd_in_kernel(raw.fileno(), out.fileno(), size) != size:
                    raise CheckpointCorruptError(f"{source.uri} changed while it was being restored; restore it again")
                progress.update(size)
            else:
                while data := raw.read(WRITE_PIECE):
                    hasher.update(data)
                    if out is not None:
                        out.write(data)
                    progress.update(len(data))
    except FileNotFoundError:
        raise _Missing(name) from None
    if (found := hasher.entry()) != entry:
        raise _damaged(steps, step, name, entry, found)


def _damaged(steps: StepStore, step: int, name: str, entry: FileEntry, found: FileEntry | int
             ) -> CheckpointCorruptError:
    """The error of a file ``name`` that differs from ``entry``: ``found``, the piece that differs, or the entry of
    what was read (:func:`~taskpoint.format.pieces.entry_damage`)."""
    return CheckpointCorruptError(entry_damage(f"step {step} in {steps.directory}", entry, found, name)
                                  + ". Restore an older step (fallback=True), or save it again.")
