"""BaseCheckpoint and Checkpoint: save progress to any fsspec location and load the previous attempt's."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import uuid
import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import anyio.to_thread

from .errors import CheckpointCorruptError, CheckpointError, StorageError, StorageNotFound
from .folders import load_folder, refuse_folder_destination, source_exists
from .format.codecs import Codec, get_codec
from .format.records import MANIFEST_SUFFIX, Manifest, ObjectRecord
from .payloads import Payload, payload_class, payload_for
from .storage import Location, RetryPolicy, normalize_uri
from .transfer import SourceIsFolder, guess_kind, read_payload, write_payload
from .workspace import Workspace

_TEMPLATE = re.compile(r"\{\{.*?\}\}")


class BaseCheckpoint(ABC):
    """The checkpoint protocol a retried task sees: a local workspace, load the previous state, save this one."""

    @property
    @abstractmethod
    def path(self) -> Path:
        """The local workspace folder where loads land; it exists while the checkpoint is open."""

    @abstractmethod
    def prev_exists(self) -> bool:
        """True when there is a previous checkpoint to load."""

    @abstractmethod
    async def load(self) -> Path | None:
        """Load the previous checkpoint into :attr:`path`; None when there is none."""

    @abstractmethod
    async def save(self, data: Any) -> None:
        """Save ``data`` as this attempt's checkpoint."""

    @abstractmethod
    def load_sync(self) -> Path | None:
        """Blocking twin of :meth:`load`."""

    @abstractmethod
    def save_sync(self, data: Any) -> None:
        """Blocking twin of :meth:`save`."""


class Checkpoint(BaseCheckpoint):
    """A checkpoint saved to ``checkpoint_dest`` and loaded from ``checkpoint_src``.

    Both are fsspec URIs (local paths, ``file://``, ``memory://``, ``s3://``, ``gs://``, ``az://``, chained
    URLs) or ``os.PathLike`` objects. ``save`` accepts bytes-like data, or a path naming a file or a
    directory; a directory is stored as a compressed tar of its top-level entries. Saves are atomic and
    streamed; loads are verified against the size and CRC32 recorded at save time and extracted safely.

    Args:
        checkpoint_dest: where this attempt saves.
        checkpoint_src: where the previous attempt saved; None, empty, or an unfilled ``{{...}}`` template
            mean "no previous checkpoint".
        storage_options: passed to fsspec for both locations (credentials, endpoint_url, ...).
        workspace: a local folder to use as :attr:`path` instead of a private temp folder. It is not
            deleted by :meth:`close`, and no two open checkpoints may share it.
        codec: archive codec for directories: ``"gzip"`` (default, readable by any gzip tool and by
            Flyte), ``"zstd"``, or ``"none"``.
        level: compression level for the codec; None picks a fast default.
        retry: how storage failures are retried; see :class:`~taskpoint.RetryPolicy`.
    """

    def __init__(
        self,
        checkpoint_dest: str | os.PathLike[str],
        checkpoint_src: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        workspace: str | os.PathLike[str] | None = None,
        codec: str = "gzip",
        level: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        dest = normalize_uri(checkpoint_dest, "checkpoint_dest").strip()
        if not dest or _TEMPLATE.search(dest):
            raise ValueError(f"checkpoint_dest must be a URI or path, got {checkpoint_dest!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, not {type(storage_options).__name__}")
        self._codec: Codec = get_codec(codec)
        if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
            raise TypeError(f"level must be an int or None, not {type(level).__name__}")
        self._level = level
        self._retry = retry or RetryPolicy()
        self._dest = Location(dest, storage_options, self._retry)
        source = clean_source_uri(checkpoint_src)
        self._src = Location(source, storage_options, self._retry) if source is not None else None
        self._lock = threading.Lock()
        self._loaded: Path | None = None
        self._closed = False
        self._workspace = Workspace(workspace)

    # -- properties --------------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._workspace.path

    @property
    def remote_destination(self) -> str:
        """The URI this checkpoint saves to."""
        return self._dest.uri

    @property
    def remote_source(self) -> str | None:
        """The URI of the previous checkpoint, or None when there is none."""
        return self._src.uri if self._src is not None else None

    # -- lifecycle ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Delete the private workspace (a given ``workspace=`` folder is kept). Safe to call twice."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._workspace.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint(dest={self.remote_destination!r}, src={self.remote_source!r}, path={str(self.path)!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint for {self.remote_destination} is closed; create a new one")

    # -- async twins -------------------------------------------------------------------------------------

    async def load(self) -> Path | None:
        return await anyio.to_thread.run_sync(self.load_sync)

    async def save(self, data: Any) -> None:
        await anyio.to_thread.run_sync(self.save_sync, data)

    async def prev_exists_async(self) -> bool:
        """Async twin of :meth:`prev_exists`."""
        return await anyio.to_thread.run_sync(self.prev_exists)

    # -- existence ---------------------------------------------------------------------------------------

    def prev_exists(self) -> bool:
        self._check_open()
        return self._src is not None and source_exists(self._src)  # an object, or a folder (folders.py)

    # -- save --------------------------------------------------------------------------------------------

    def save_sync(self, data: Any) -> None:
        payload = payload_for(data)
        with self._lock:
            self._check_open()
            refuse_folder_destination(self._dest)  # a folder or prefix is refused before anything is written
            save_object(self._dest, payload, self._codec, self._level)

    # -- load --------------------------------------------------------------------------------------------

    def load_sync(self) -> Path | None:
        with self._lock:
            self._check_open()
            if self._loaded is not None and self._loaded.exists():
                return self._loaded
            if self._src is None:
                return None
            try:
                result = load_object(self._src, self.path)
            except SourceIsFolder:  # a folder or prefix (flytekit 1.x's layout): a directory checkpoint
                result = load_folder(self._src, self.path)
            self._loaded = result
            return result


def clean_source_uri(value: str | os.PathLike[str] | None) -> str | None:
    """The previous-checkpoint URI with whitespace and quotes stripped; None when empty or a template."""
    if value is None:
        return None
    text = normalize_uri(value, "checkpoint_src").strip().strip("'\"").strip()
    if not text or _TEMPLATE.search(text):
        return None
    return text


# -- the record protocol, shared with the runtime's lineage search -------------------------------------


def save_object(dest: Location, payload: Payload, codec: Codec, level: int | None) -> ObjectRecord:
    """Write ``payload`` to ``dest`` atomically and record its kind, size and CRC32 beside it."""
    record_loc = dest.sibling(MANIFEST_SUFFIX)
    started = time.time()
    previous = read_manifest(record_loc, tolerate_corrupt=True)
    pending = ObjectRecord(kind=payload.kind, codec=codec.name if payload.archived else "raw",
                           save_id=uuid.uuid4().hex, created=time.time(), size=payload.size())
    committed_before = previous.committed if previous else None
    record_loc.write_small(Manifest(committed=committed_before, pending=pending).to_bytes(),
                           action="save a checkpoint to")
    try:
        size, digest = write_payload(dest, payload, codec, level, digest="crc32", size_hint=payload.size())
    except BaseException:
        _restore_manifest(record_loc, committed_before)
        raise
    record = ObjectRecord(kind=pending.kind, codec=pending.codec, save_id=pending.save_id,
                          created=pending.created, size=size, crc32=digest)
    try:
        record_loc.write_small(Manifest(committed=record).to_bytes(), action="record the checkpoint at")
    except StorageError as exc:
        raise StorageError(f"the checkpoint at {dest.uri} was written, but its record could not be updated "
                           f"({exc}); it will load without checksum verification. Save again to fix it.") from exc
    if previous is None or previous.needs_sweep:
        dest.sweep_leftovers(started_before=started)
    return record


def _restore_manifest(record_loc: Location, committed: ObjectRecord | None) -> None:
    """After a failed save: the previous record again, marked so that the next save sweeps leftovers."""
    # Best effort: if this write fails too, the pending entry left in place is harmless and also triggers it.
    with contextlib.suppress(Exception):
        record_loc.write_small(Manifest(committed=committed, interrupted=True).to_bytes())


def read_manifest(record_loc: Location, *, tolerate_corrupt: bool = False) -> Manifest | None:
    """The record beside a checkpoint object, or None when there is none."""
    data = record_loc.read_small()
    if data is None:
        return None
    try:
        return Manifest.from_bytes(data, record_loc.uri)
    except CheckpointCorruptError:
        if tolerate_corrupt:
            return None
        raise


def load_object(src: Location, workspace: Path) -> Path | None:
    """Load the checkpoint at ``src`` into ``workspace``; None when nothing was ever saved there."""
    manifest = read_manifest(src.sibling(MANIFEST_SUFFIX))

    def choose(head: bytes, size: int | None) -> type[Payload]:
        record = _choose_record(manifest, size)
        return payload_class(record.kind, src.uri) if record else guess_kind(head)

    def verify(kind: str, size: int, digest: str) -> None:
        _verify(manifest, kind, size, digest, src.uri)

    committed = manifest.committed if manifest is not None else None
    digest = "sha256" if committed is not None and committed.crc32 is None and committed.sha256 else "crc32"
    result = read_payload(src, workspace, choose, verify, digest)
    if result is None:
        if manifest is not None and manifest.committed is not None:
            raise CheckpointCorruptError(
                f"the checkpoint at {src.uri} is recorded as saved but its object is missing; it was deleted "
                f"or moved. Restore the object, or delete its record ({MANIFEST_SUFFIX}) to start over.")
        if src.container_missing():
            raise StorageNotFound(f"could not load {src.uri}: the bucket or container does not exist. "
                               "Create it, or fix the URI.")
    return result


def _choose_record(manifest: Manifest | None, size: int | None) -> ObjectRecord | None:
    if manifest is None:
        return None
    committed, pending = manifest.committed, manifest.pending
    if committed is not None and (pending is None or size == committed.size):
        return committed
    return pending or committed


def _verify(manifest: Manifest | None, kind: str, size: int, digest: str, uri: str) -> None:
    if manifest is None:
        return
    committed, pending = manifest.committed, manifest.pending
    if committed is not None and committed.size == size and digest in (committed.crc32, committed.sha256):
        return
    if pending is not None and pending.kind == kind and pending.size in (None, size):
        warnings.warn(
            f"the checkpoint at {uri} was written by a save that stopped before recording its checksum; "
            "it was loaded with the archive's own checks only.", stacklevel=2)
        return
    expected = committed.size if committed else None
    raise CheckpointCorruptError(
        f"the checkpoint at {uri} does not match the checksum recorded when it was saved "
        f"(size {size}, expected {expected}); it is truncated or damaged. Save a new checkpoint, or load "
        "an older one.")
