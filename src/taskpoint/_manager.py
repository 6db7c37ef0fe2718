"""CheckpointManager: numbered steps in one directory, each committed by a manifest written last.

Layout under the manager's directory (any fsspec URL)::

    ckpt-{step}/payload-{save_id}   the payload, stored as a Checkpoint stores it (raw, or a tar archive)
    ckpt-{step}/taskpoint.json      the step's manifest, written after the payload: the commit

A step exists when, and only when, its manifest does. Every save writes its payload under a name of its
own and the manifest names the payload it commits, so two writers of the same step never mix their data:
the last manifest wins, and it names one writer's complete payload. Objects in a step folder that no
manifest names are leftovers of interrupted or superseded saves; they are removed once older than a grace
period, so that a save still in progress elsewhere is never disturbed.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import operator
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
import warnings
import weakref
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio.to_thread

from ._checkpoint import _Workspace
from ._codecs import Codec, get_codec
from ._context import ctx
from ._manifest import ObjectRecord, StepManifest
from ._payloads import Payload, payload_class, payload_for
from ._saver import NotTransferable, SaverProcess, SaverUnavailable, can_write_elsewhere, release_freed_memory
from ._storage import LEFTOVER_GRACE_SECONDS, Location, RetryPolicy, normalize_uri
from ._transfer import read_payload
from ._transfer import write_payload as write_here
from .errors import CheckpointCorruptError, CheckpointError, StorageError, add_note

#: Name of a step's manifest inside its folder; its presence is the step's commit.
MANIFEST_NAME = "taskpoint.json"

_STEP_FOLDER = re.compile(r"ckpt-(0|[1-9][0-9]*)")
_PAYLOAD_NAME = re.compile(r"payload-[0-9a-f]{32}")
#: What a save of ours can leave in a step folder: payloads, and the temp files of atomic writes.
_OURS = re.compile(r"\.?(?:payload-[0-9a-f]{32}|taskpoint\.json)(?:\.[0-9a-f]{12}\.tmp)?")
#: How often restore follows a step that another writer overwrites while it is being read.
_RESTORE_ATTEMPTS = 5

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M")


def _in_thread(method: Callable[Concatenate[M, P], R]) -> Callable[Concatenate[M, P], Awaitable[R]]:
    """The async twin of a blocking method: the same call, run in a worker thread (asyncio and trio)."""

    async def twin(self: M, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await anyio.to_thread.run_sync(functools.partial(method, self, *args, **kwargs))

    twin.__name__ = twin.__qualname__ = f"{method.__name__}_async"
    twin.__doc__ = f"Async twin of :meth:`{method.__name__}`: the same call, run in a worker thread."
    return twin


class CheckpointManager:
    """Numbered checkpoints ("steps") in one directory, with commits, checksums, retention and metadata.

    ``directory`` is any fsspec URL or local path. ``save`` accepts what :meth:`Checkpoint.save
    <taskpoint.Checkpoint.save>` accepts (bytes-like data, or a path naming a file or directory). A step is
    visible to :meth:`steps`, :meth:`latest_step` and :meth:`restore` only once its manifest is written,
    after the payload; :meth:`restore` verifies the sha256 recorded there while it streams.

    The blocking methods carry the plain names; each has an async twin named ``<name>_async`` (as
    :meth:`Checkpoint.prev_exists_async <taskpoint.Checkpoint.prev_exists_async>`) that runs it in a worker
    thread, and the manager is both a context manager and an async context manager.

    Args:
        directory: where the steps live; created on first save.
        keep: keep the ``keep`` newest committed steps and delete older ones after each save; None (the
            default) keeps everything.
        keep_every: with ``keep``, also keep every step divisible by ``keep_every``.
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        codec: archive codec for directories: ``"gzip"`` (default), ``"zstd"`` or ``"none"``.
        level: compression level for the codec; None picks a fast default.
        async_save: when True, :meth:`save` returns once the data is snapshotted and uploads in the
            background (``save(..., blocking=...)`` overrides it per call).
        retry: how storage failures are retried; see :class:`~taskpoint.RetryPolicy`.
        grace_seconds: age after which an object that no manifest names (left by a killed or superseded
            save) is removed by later saves and :meth:`gc`. It must exceed the time between a payload's
            upload and its manifest; 0 removes leftovers at once and is safe only with a single writer.
        snapshot_dir: where background saves copy files and directories before uploading them (the
            system temp folder by default). The copy needs as much space as the data; on the source's
            filesystem it is fastest (in-kernel, or reflinked where the filesystem supports it).
        background_process: background saves to local disk and object stores write the snapshot from a
            helper process (True, the default) so they never hold this process's GIL; False writes it
            from a thread of this process. ``memory://`` and payloads that cannot be pickled always use
            a thread. Blocking saves always run in the caller's thread.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        codec: str = "gzip",
        level: int | None = None,
        async_save: bool = False,
        retry: RetryPolicy | None = None,
        grace_seconds: float = LEFTOVER_GRACE_SECONDS,
        snapshot_dir: str | os.PathLike[str] | None = None,
        background_process: bool = True,
    ) -> None:
        uri = normalize_uri(directory, "directory").strip()
        if not uri:
            raise ValueError("directory must be a URI or path, got an empty string")
        if not uri.endswith("://"):
            uri = uri.rstrip("/") or "/"
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, not {type(storage_options).__name__}")
        self._keep = _positive_or_none(keep, "keep")
        self._keep_every = _positive_or_none(keep_every, "keep_every")
        self._grace = _check_grace(grace_seconds)
        self._snapshot_dir = None if snapshot_dir is None else os.fspath(normalize_uri(snapshot_dir, "snapshot_dir"))
        if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
            raise TypeError(f"level must be an int or None, not {type(level).__name__}")
        self._codec: Codec = get_codec(codec)
        self._level = level
        self._async_save = bool(async_save)
        self._root = Location(uri, storage_options, retry)
        self._claims = _Claims((str(self._root.fs.protocol), self._root.path))
        self._lock = threading.RLock()  # save, delete, gc, close and wait_until_finished, one at a time
        #: The step the last successful :meth:`restore` returned (useful with ``fallback=True``).
        self.restored_step: int | None = None
        self._restore_lock = threading.Lock()  # restores into the manager's own workspace
        self._workspace: _Workspace | None = None
        self._closed = False
        self._container_seen = False  # the bucket or container is known to exist
        self._background = _Background()
        weakref.finalize(self, self._background.report_unclaimed, uri)
        #: The helper process of background saves: started by the first one, None until then or when off.
        self._saver: SaverProcess | None = None
        self._use_saver = bool(background_process) and can_write_elsewhere(self._root)
        self._saver_lock = threading.Lock()

    # -- properties and lifecycle --------------------------------------------------------------------------

    @property
    def directory(self) -> str:
        """The URI of the directory that holds the steps."""
        return self._root.uri

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep={self._keep}, keep_every={self._keep_every})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> CheckpointManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_async()

    def close(self) -> None:
        """Wait for a background save, delete the restore workspace, and raise a background error if any.

        Safe to call twice. Paths returned by :meth:`restore` without ``into`` are gone afterwards.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._settle(wait=True)
            finally:
                if self._workspace is not None:
                    self._workspace.close()
                with self._saver_lock:
                    saver, self._saver, self._use_saver = self._saver, None, False
                if saver is not None:
                    saver.close()

    def wait_until_finished(self) -> None:
        """Block until the background save (if any) has committed; raise its error if it failed."""
        with self._lock:
            self._settle(wait=True)

    # -- save ----------------------------------------------------------------------------------------------

    def save(self, data: Any, step: int, *, metadata: dict[str, Any] | None = None, overwrite: bool = False,
             blocking: bool | None = None) -> str:
        """Save ``data`` as ``step``; return the URI of the step's folder.

        ``metadata`` is a dict of JSON values, given back exactly by :meth:`metadata`. Saving a step that
        exists raises FileExistsError unless ``overwrite=True`` (two writers checking at the same moment
        can both pass the check; the last to commit wins, with its own complete data). With
        ``blocking=False`` (or ``async_save=True``) the call returns once the data is snapshotted: the caller
        may change or delete it at once. At most one save is in flight; the next call waits for it, and an
        error it met is raised by the next call instead of doing anything else.
        """
        step = _check_step(step)
        record_metadata = _check_metadata(metadata)
        context = ctx()
        attempt = context.attempt if context is not None else None
        background = self._async_save if blocking is None else not blocking
        with self._lock:
            self._check_open()
            self._settle(wait=True)
            previous = self._object(step, MANIFEST_NAME).read_small()
            if previous is not None and not overwrite:
                raise FileExistsError(f"step {step} already exists in {self.directory}; pass overwrite=True to "
                                      "replace it, or save under a new step")
            replaced = _payload_named(previous, self._object(step, MANIFEST_NAME).uri)
            payload = payload_for(data)  # after the existence check: some kinds (PyTree) serialize here
            job = functools.partial(self._write_step, step, record_metadata, attempt, replaced)
            if not background:
                job(payload)
            else:
                self._start_background(step, payload, job)
        return self._step_uri(step)

    def _start_background(self, step: int, payload: Payload, job: Callable[..., None]) -> None:
        scratch = Path(tempfile.mkdtemp(prefix=f"{SNAPSHOT_PREFIX}{_host_tag()}-{os.getpid()}-",
                                        dir=self._snapshot_dir))
        _sweep_dead_snapshots(scratch.parent)
        try:
            snapshot = payload.snapshot(scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        if snapshot is None:
            shutil.rmtree(scratch, ignore_errors=True)
            warnings.warn(f"payloads of kind {payload.kind!r} cannot be snapshotted; step {step} is saved in "
                          "the foreground", stacklevel=3)
            job(payload)
            return

        def upload() -> None:
            try:
                job(snapshot, self._helper_process())
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

        self._background.start(step, upload)

    def _helper_process(self) -> SaverProcess | None:
        """The helper process for background saves, started on first use; None when off or unavailable."""
        with self._saver_lock:
            if self._saver is not None and not self._saver.alive():
                self._saver.close()
                self._saver = None  # it died (killed, out of memory): start a new one
            if self._saver is None and self._use_saver:
                try:
                    self._saver = SaverProcess()
                except SaverUnavailable as exc:
                    self._use_saver = False
                    warnings.warn(f"taskpoint could not start its save process ({exc}); background saves of "
                                  f"{self.directory} run in a thread of this process", RuntimeWarning, stacklevel=2)
            return self._saver

    def _write_step(self, step: int, metadata: dict[str, Any], attempt: int | None, replaced: str | None,
                    payload: Payload, saver: SaverProcess | None = None) -> None:
        """Upload the payload under a fresh name, then commit it with the manifest; then tidy up."""
        save_id = uuid.uuid4().hex
        name = f"payload-{save_id}"
        payload_loc = self._object(step, name)
        created = time.time()
        size, digest = write_payload(payload_loc, payload, self._codec, self._level, saver)
        record = ObjectRecord(kind=payload.kind, codec=self._codec.name if payload.archived else "raw",
                              save_id=save_id, created=created, size=size, sha256=digest)
        manifest = StepManifest(step=step, payload=name, record=record, attempt=attempt, metadata=metadata)
        try:
            self._object(step, MANIFEST_NAME).write_small(manifest.to_bytes(), action="commit the checkpoint at")
        except BaseException:
            _quietly(payload_loc.remove)
            raise
        if replaced is not None and replaced != name and not self._claims.is_restoring(step):
            _quietly(self._object(step, replaced).remove)
        self._tidy()

    def _tidy(self) -> None:
        """After a commit: apply retention and remove old leftovers. Never fails the save that committed."""
        try:
            folders = self._scan()
            self._retain(folders)
            self._sweep(folders, self._grace)
        except Exception as exc:
            warnings.warn(f"taskpoint saved the new step but could not tidy {self.directory} ({exc}); old steps "
                          "and leftovers will be removed by a later save or gc()", RuntimeWarning, stacklevel=2)

    # -- queries -------------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps, oldest first. A background save appears once it has committed."""
        self._check_open()
        self._settle(wait=False)
        return sorted(step for step, folder in self._scan().items() if folder.committed)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def list_checkpoints(self) -> dict[int, str]:
        """Each committed step with the URI of its folder, oldest first."""
        return {step: self._step_uri(step) for step in self.steps()}

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with ``step`` (the newest when None), read without downloading the payload."""
        if step is None:
            step = self._newest()
        else:
            self._check_open()
            self._settle(wait=False)
        manifest = self._manifest(_check_step(step))
        if manifest is None:
            raise FileNotFoundError(f"step {step} does not exist in {self.directory}")
        return manifest.metadata

    # -- restore -------------------------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, into: str | os.PathLike[str] | None = None,
                fallback: bool = False) -> Path:
        """Restore ``step`` (the newest when None) and return it as :meth:`Checkpoint.load
        <taskpoint.Checkpoint.load>` does: a folder for directories, ``<folder>/payload`` for bytes and files.

        Without ``into`` the result lands in a folder of the manager's own, removed by :meth:`close`; with
        it, the checkpoint's entries replace same-named entries in ``into``. The sha256 recorded at save is
        verified while streaming, and nothing lands before it matches: a mismatch raises
        CheckpointCorruptError naming the step. With ``fallback=True`` a damaged step is skipped with a
        warning for the newest older one that verifies; storage errors are raised, never skipped.
        :attr:`restored_step` says which step the last successful restore returned.
        """
        if step is None:
            candidates = list(reversed(self.steps()))
            if not candidates:
                raise FileNotFoundError(f"there is no committed checkpoint in {self.directory}")
        else:
            self._check_open()
            self._settle(wait=False)
            step = _check_step(step)
            candidates = [step, *(s for s in reversed(self.steps()) if s < step)] if fallback else [step]
        target = None if into is None else Path(normalize_uri(into, "into"))
        first_error: Exception | None = None
        for index, candidate in enumerate(candidates):
            try:
                result = self._restore_step(candidate, target)
                self.restored_step = candidate
                return result
            except (CheckpointCorruptError, FileNotFoundError) as exc:
                missing_request = index == 0 and step is not None and isinstance(exc, FileNotFoundError)
                if not fallback or missing_request:
                    raise
                first_error = first_error or exc
                warnings.warn(f"step {candidate} in {self.directory} could not be restored ({exc}); trying the "
                              "next older step", stacklevel=2)
        assert first_error is not None
        add_note(first_error, "no older step could be restored either")
        raise first_error

    def _restore_step(self, step: int, into: Path | None) -> Path:
        if not self._claims.start_restore(step):
            raise FileNotFoundError(f"step {step} in {self.directory} is being deleted")
        try:
            if into is not None:
                return self._read_step(step, into)
            with self._restore_lock:
                if self._workspace is None:
                    self._workspace = _Workspace(None)
                folder = self._workspace.path / f"ckpt-{step}"
                shutil.rmtree(folder, ignore_errors=True)
                try:
                    return self._read_step(step, folder)
                except BaseException:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise
        finally:
            self._claims.end_restore(step)

    def _read_step(self, step: int, workspace: Path) -> Path:
        """Stream the payload the manifest names into ``workspace``, following concurrent overwrites."""
        manifest = self._manifest(step)
        for _ in range(_RESTORE_ATTEMPTS):
            if manifest is None:
                raise FileNotFoundError(f"step {step} does not exist in {self.directory} (or was just deleted)")
            result = self._read_payload(step, manifest, workspace)
            if result is not None:
                return result
            now = self._manifest(step)
            if now is not None and now.payload == manifest.payload:
                raise CheckpointCorruptError(
                    f"step {step} in {self.directory} is committed but its payload {manifest.payload} is missing; "
                    "it was deleted outside taskpoint. Restore an older step (fallback=True), or delete this one.")
            manifest = now  # overwritten or deleted while we read: follow it
        raise CheckpointError(f"step {step} in {self.directory} kept being overwritten while it was restored; "
                              "try again once the other writer has finished")

    def _read_payload(self, step: int, manifest: StepManifest, workspace: Path) -> Path | None:
        src = self._object(step, manifest.payload)
        record = manifest.record

        def choose(head: bytes, size: int | None) -> type[Payload]:
            return payload_class(record.kind, src.uri)

        def verify(kind: str, size: int, digest: str) -> None:
            if (kind, size, digest) != (record.kind, record.size, record.sha256):
                raise CheckpointCorruptError(
                    f"step {step} in {self.directory} does not match the sha256 recorded when it was saved "
                    f"(read {size} bytes, expected {record.size}); it is damaged. Restore an older step "
                    "(fallback=True), or save it again.")

        try:
            return read_payload(src, workspace, choose, verify)
        except FileNotFoundError:  # deleted under a streaming read (object stores): check the manifest
            return None
        except CheckpointCorruptError as exc:
            if f"step {step} " in str(exc):
                raise
            raise type(exc)(f"step {step} in {self.directory} is damaged: {exc}") from exc

    # -- delete and garbage collection ---------------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Delete a committed step: its manifest first (so it stops existing at once), then its payload."""
        step = _check_step(step)
        with self._lock:
            self._check_open()
            self._settle(wait=True)
            folder = self._scan(step).get(step)
            if folder is None or not folder.committed:
                raise FileNotFoundError(f"step {step} does not exist in {self.directory}")
            if not self._claims.start_delete(step):
                raise CheckpointError(f"step {step} in {self.directory} is being restored; delete it once the "
                                      "restore has finished")
            try:
                self._delete_step(step, folder)
            finally:
                self._claims.end_delete(step)

    def gc(self, grace_seconds: float | None = None) -> list[str]:
        """Remove leftovers of interrupted or superseded saves older than the grace period; return their URIs.

        Committed steps are never touched (retention is applied by :meth:`save`), nor anything whose name
        taskpoint would not write. On S3 this also aborts the unfinished multipart uploads of payloads (saves
        killed in the middle of an upload). ``grace_seconds`` overrides the manager's for this call.
        """
        grace = self._grace if grace_seconds is None else _check_grace(grace_seconds)
        with self._lock:
            self._check_open()
            self._settle(wait=True)
            return self._sweep(self._scan(), grace) + self._sweep_uploads(grace)

    def _retain(self, folders: dict[int, _Folder]) -> None:
        if self._keep is None:
            return
        committed = sorted(step for step, folder in folders.items() if folder.committed)
        kept = set(committed[-self._keep:])
        if self._keep_every is not None:
            kept.update(step for step in committed if step % self._keep_every == 0)
        for step in committed:
            if step in kept or not self._claims.start_delete(step):
                continue  # kept, or being restored in this process: a later save deletes it
            try:
                self._delete_step(step, folders.pop(step))
            finally:
                self._claims.end_delete(step)

    def _delete_step(self, step: int, folder: _Folder) -> None:
        manifest = self._manifest(step, tolerate_corrupt=True)
        self._object(step, MANIFEST_NAME).remove()
        keep = {MANIFEST_NAME}
        if manifest is not None and _PAYLOAD_NAME.fullmatch(manifest.payload):
            self._object(step, manifest.payload).remove()
            keep.add(manifest.payload)
        self._sweep_folder(step, folder, self._grace, keep)

    def _sweep(self, folders: dict[int, _Folder], grace: float) -> list[str]:
        removed: list[str] = []
        for step, folder in sorted(folders.items()):
            keep: set[str] = set()
            if folder.committed:
                if self._claims.is_restoring(step):
                    continue
                extras = [name for name in folder.objects if name != MANIFEST_NAME and _OURS.fullmatch(name)]
                if len(extras) <= 1:
                    continue  # the usual committed step: its manifest and its payload
                manifest = self._manifest(step, tolerate_corrupt=True)
                if manifest is None:
                    continue  # never guess what an unreadable manifest commits
                keep = {MANIFEST_NAME, manifest.payload}
            removed += self._sweep_folder(step, folder, grace, keep)
        return removed

    def _sweep_uploads(self, grace: float) -> list[str]:
        """S3: abort the unfinished multipart uploads of payloads that saves killed mid-upload left behind
        (invisible as objects, but billed). Only our payload names, only older than ``grace`` by the server's
        initiation time. Run by :meth:`gc` only, not after every save: a server whose clock (or whose fake
        initiation time: moto's is always 2010) is off would otherwise abort another writer's upload in
        flight. Best effort and quiet: a role may lack the ListBucketMultipartUploads permission."""
        if not self._root.is_object_store:
            return []
        root = self._root.path.rstrip("/") + "/"
        bucket = root.partition("/")[0]
        now, removed = time.time(), []
        try:
            uploads = self._root.unfinished_uploads()
        except Exception:
            return []
        for key, upload_id, initiated in uploads:
            path = f"{bucket}/{key}"
            folder, _, name = path[len(root):].partition("/") if path.startswith(root) else ("", "", "")
            step = _STEP_FOLDER.fullmatch(folder)
            if step is None or not _PAYLOAD_NAME.fullmatch(name):
                continue  # not a payload of ours
            if grace > 0 and now - initiated < grace:
                continue  # maybe a save still in progress
            try:
                self._root.abort_upload(key, upload_id)
            except Exception:
                continue
            removed.append(self._object(int(step.group(1)), name).uri)
        return removed

    def _sweep_folder(self, step: int, folder: _Folder, grace: float, keep: set[str]) -> list[str]:
        """Remove our objects in ``folder`` that are not in ``keep`` and older than ``grace``."""
        now = time.time()
        removed: list[str] = []
        for name, mtime in folder.objects.items():
            if name in keep or not _OURS.fullmatch(name):
                continue
            if grace > 0 and (mtime is None or now - mtime < grace):
                continue  # maybe a save still in progress
            target = self._object(step, name)
            target.remove()
            removed.append(target.uri)
        if not self._root.is_object_store:
            # Object stores have no folders; elsewhere an empty one goes (rmdir refuses a non-empty folder).
            _quietly(lambda: self._root.fs.rmdir(f"{self._root.path.rstrip('/')}/ckpt-{step}"))
        return removed

    # -- internals -----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager for {self.directory} is closed; create a new one")

    def _settle(self, *, wait: bool) -> None:
        """Raise the error of a finished background save; with ``wait``, first let it finish."""
        self._background.settle(wait=wait)

    def _newest(self) -> int:
        latest = self.latest_step()
        if latest is None:
            raise FileNotFoundError(f"there is no committed checkpoint in {self.directory}")
        return latest

    def _step_uri(self, step: int) -> str:
        return f"{self.directory}/ckpt-{step}"

    def _object(self, step: int, name: str) -> Location:
        return self._root.sibling(f"/ckpt-{step}/{name}")

    def _manifest(self, step: int, *, tolerate_corrupt: bool = False) -> StepManifest | None:
        location = self._object(step, MANIFEST_NAME)
        data = location.read_small()
        if data is None:
            return None
        try:
            manifest = StepManifest.from_bytes(data, location.uri)
            if manifest.step != step or not _PAYLOAD_NAME.fullmatch(manifest.payload):
                raise CheckpointCorruptError(f"the checkpoint record {location.uri} does not describe step "
                                             f"{step}; delete the step, or save it again with overwrite=True")
        except CheckpointCorruptError as exc:
            if tolerate_corrupt:
                return None
            raise CheckpointCorruptError(f"step {step} in {self.directory}: {exc}") from exc
        return manifest

    def _scan(self, step: int | None = None) -> dict[int, _Folder]:
        """Every ``ckpt-N`` folder (or only ``step``'s) with its objects, from one recursive listing."""
        fs, root = self._root.fs, self._root.path.rstrip("/")
        base = root if step is None else f"{root}/ckpt-{step}"

        def find() -> dict[str, dict[str, Any]]:
            fs.invalidate_cache(base)
            try:
                found = fs.find(base, withdirs=True, detail=True)
            except FileNotFoundError:
                return {}
            return found if isinstance(found, dict) else {}

        found = self._root.retry.call(find, action="list the checkpoints in", uri=self.directory)
        folders: dict[int, _Folder] = {}
        for path, info in found.items():
            parts = path[len(root) + 1:].split("/") if path.startswith(root + "/") else []
            match = _STEP_FOLDER.fullmatch(parts[0]) if parts else None
            if match is None:
                continue
            folder = folders.setdefault(int(match.group(1)), _Folder())
            if len(parts) == 2 and parts[1] and info.get("type") != "directory":
                folder.objects[parts[1]] = _modified(info)
        if folders or step is not None or self._container_seen:
            self._container_seen = self._container_seen or bool(folders)
            return folders
        # Nothing listed: a missing bucket must not read as "no checkpoint". Asked until it once exists.
        if self._root.container_missing():
            raise StorageError(f"could not list {self.directory}: the bucket or container does not exist. "
                               "Create it, or fix the URI.")
        self._container_seen = True
        return folders

    # -- async twins ---------------------------------------------------------------------------------------

    save_async = _in_thread(save)
    restore_async = _in_thread(restore)
    metadata_async = _in_thread(metadata)
    steps_async = _in_thread(steps)
    latest_step_async = _in_thread(latest_step)
    list_checkpoints_async = _in_thread(list_checkpoints)
    delete_async = _in_thread(delete)
    gc_async = _in_thread(gc)
    wait_until_finished_async = _in_thread(wait_until_finished)
    close_async = _in_thread(close)


@dataclass
class _Folder:
    """One ``ckpt-N`` folder as listed: its objects' names and modification times (None when unknown)."""

    objects: dict[str, float | None] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return MANIFEST_NAME in self.objects


class _Claims:
    """Steps this process is restoring or deleting, per directory, shared by all managers in the process.

    Retention and :meth:`CheckpointManager.delete` skip a step being restored; a restore treats a step
    being deleted as gone.
    """

    _lock = threading.Lock()
    _restoring: collections.Counter[tuple[str, str, int]] = collections.Counter()
    _deleting: set[tuple[str, str, int]] = set()

    def __init__(self, directory: tuple[str, str]) -> None:
        self._directory = directory

    def start_restore(self, step: int) -> bool:
        key = (*self._directory, step)
        with self._lock:
            if key in self._deleting:
                return False
            self._restoring[key] += 1
            return True

    def end_restore(self, step: int) -> None:
        key = (*self._directory, step)
        with self._lock:
            self._restoring[key] -= 1
            if self._restoring[key] <= 0:
                del self._restoring[key]

    def is_restoring(self, step: int) -> bool:
        with self._lock:
            return (*self._directory, step) in self._restoring

    def start_delete(self, step: int) -> bool:
        key = (*self._directory, step)
        with self._lock:
            if key in self._restoring:
                return False
            self._deleting.add(key)
            return True

    def end_delete(self, step: int) -> None:
        with self._lock:
            self._deleting.discard((*self._directory, step))


class _Background:
    """The one background save of a manager, and its error until someone has been told about it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._step = -1
        self._error: BaseException | None = None

    def start(self, step: int, upload: Callable[[], None]) -> None:
        def run() -> None:
            try:
                upload()
            except BaseException as exc:  # kept for the next call, or reported at exit: never lost
                self._error = exc
            finally:
                release_freed_memory()

        self._step, self._error = step, None
        # Not a daemon: an interpreter that exits without close() still finishes the upload first.
        self._thread = threading.Thread(target=run, name=f"taskpoint-save-step-{step}")
        self._thread.start()

    def settle(self, *, wait: bool) -> None:
        thread = self._thread
        if thread is None:
            return
        if wait:
            thread.join()
        elif thread.is_alive():
            return
        with self._lock:
            if self._thread is not thread:
                return  # another caller settled it
            self._thread, error, self._error = None, self._error, None
        if error is not None:
            add_note(error, f"raised here because the background save of step {self._step} failed")
            raise error

    def report_unclaimed(self, directory: str) -> None:
        """At exit (or garbage collection): say so if a background error was never raised to anyone.

        The error's traceback holds the manager, so a manager with an unreported error lives until exit.
        """
        thread, error = self._thread, self._error
        if thread is not None and not thread.is_alive() and error is not None:
            warnings.warn(f"the background save of step {self._step} to {directory} failed and no later call "
                          f"reported it: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=1)


#: Start of the names of background-save snapshot folders: ``taskpoint-snapshot-<host>-<pid>-<random>``.
SNAPSHOT_PREFIX = "taskpoint-snapshot-"
_SNAPSHOT_NAME = re.compile(re.escape(SNAPSHOT_PREFIX) + r"(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[^/]+")


def _host_tag() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _sweep_dead_snapshots(folder: Path) -> None:
    """Remove snapshot folders that killed processes of this host left in ``folder`` (each as large as the
    data it copied). Only folders whose process is gone and that are older than the leftover grace period:
    a pid namespace that shares this folder but not our view of its processes keeps its live snapshots."""
    host, me, cutoff = _host_tag(), os.getpid(), time.time() - LEFTOVER_GRACE_SECONDS
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = _SNAPSHOT_NAME.fullmatch(entry.name)
        if match is None or match["host"] != host or int(match["pid"]) == me:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime > cutoff or _process_alive(int(match["pid"])):
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def write_payload(location: Location, payload: Payload, codec: Codec, level: int | None,
                  saver: SaverProcess | None = None) -> tuple[int, str]:
    """Write a step's payload to ``location``: from ``saver``'s process when given and it can reach the
    location (the manager starts one only for a directory other processes can reach), else from this thread.
    A save process that dies or cannot take the payload is never fatal: the payload (under its unique name)
    is written again from here; a killed process's partial object has no manifest and is swept like any
    leftover."""
    if saver is not None:
        try:
            return saver.write_payload(location, payload, codec.name, level)
        except NotTransferable:
            pass
        except SaverUnavailable as exc:
            warnings.warn(f"{exc}; taskpoint writes {location.uri} from this process instead", RuntimeWarning,
                          stacklevel=2)
    return write_here(location, payload, codec, level)


def _positive_or_none(value: int | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _check_grace(seconds: Any) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"grace_seconds must be a number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError("step must be an int, not bool")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, not {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def _check_metadata(metadata: Any) -> dict[str, Any]:
    """A private copy of ``metadata`` after checking that JSON gives it back exactly as passed."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values, not {type(metadata).__name__}")
    try:
        copy = json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must hold only JSON values (dict, list, str, int, float, bool, None): {exc}. "
                        "Convert numpy numbers, paths or datetimes first; nothing was saved.") from exc
    if copy != metadata:
        raise TypeError("metadata would not come back as passed: use str keys and lists rather than tuples; "
                        "nothing was saved.")
    return copy  # type: ignore[no-any-return]


def _payload_named(manifest: bytes | None, uri: str) -> str | None:
    """The payload a manifest's bytes commit, or None when there is none or it is unreadable."""
    if manifest is None:
        return None
    try:
        name = StepManifest.from_bytes(manifest, uri).payload
    except CheckpointCorruptError:
        return None
    return name if _PAYLOAD_NAME.fullmatch(name) else None


def _modified(info: dict[str, Any]) -> float | None:
    """An object's modification time in seconds since the epoch, from any fsspec backend's listing."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _quietly(action: Callable[[], object]) -> None:
    """Best-effort cleanup: whatever it leaves is a leftover that gc removes later."""
    with contextlib.suppress(Exception):
        action()
