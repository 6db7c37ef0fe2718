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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio.to_thread

from . import _log
from .errors import CheckpointCorruptError, CheckpointError, StorageNotFound
from .folders import load_folder, refuse_folder_destination, source_exists
from .format.codecs import Codec, get_codec
from .format.records import MANIFEST_SUFFIX, ObjectRecord, Record
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
        """The local workspace folder where loads land, created when first read (a checkpoint that only
        saves never makes one); it exists while the checkpoint is open."""
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
        # Never the storage options (credentials); and the workspace only once it exists (reading
        # ``path`` would create it).
        path = str(self._workspace.path) if self._workspace.created else None
        return f"Checkpoint(dest={self.remote_destination!r}, src={self.remote_source!r}, path={path!r})"

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
        clock = _log.Clock()
        payload = payload_for(data)
        with self._lock:
            self._check_open()
            saved = save_object(self._dest, payload, self._codec, self._level)
        _log.transferred("save", self._dest.uri, saved.kind, saved.size, clock)

    # -- load --------------------------------------------------------------------------------------------

    def load_sync(self) -> Path | None:
        with self._lock:
            self._check_open()
            if self._loaded is not None and self._loaded.exists():
                return self._loaded
            if self._src is None:
                return None
            clock = _log.Clock()
            try:
                result = load_object(self._src, self.path)
            except SourceIsFolder:  # a folder or prefix (flytekit 1.x's layout): a directory checkpoint
                result = load_folder(self._src, self.path)
            if result is not None:
                _log.transferred("load", self._src.uri, *_log.take_verified(), clock)
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

#: The record this process last wrote beside each destination (key: filesystem protocol and record path), with
#: the local file's identity. A later save starts from it; just before it lists its new object it reads the
#: record again (on local disk only when a stat says another process replaced it), so that what another
#: writer made visible stays listed.
_written: dict[tuple[str, str], tuple[Record, tuple[int, int, int] | None]] = {}
_written_lock = threading.Lock()
#: How often a load re-reads the record and follows it when the object it read is not listed (each time, a
#: save of another process wrote the record after this load read it).
_RECORD_REREADS = 4
#: The pause before a load reads the object again under an unchanged record (a damaged object waits it once).
_RECORD_PAUSE = 0.1


def _record_key(record_loc: Location) -> tuple[str, str]:
    return str(record_loc.fs.protocol), record_loc.path


def save_object(dest: Location, payload: Payload, codec: Codec, level: int | None) -> ObjectRecord:
    """Write ``payload`` to ``dest`` atomically; its kind, size and CRC32 are recorded beside it before it
    becomes visible, next to the objects that may still be there (see :mod:`taskpoint.format.records`)."""
    record_loc = dest.sibling(MANIFEST_SUFFIX)
    key = _record_key(record_loc)
    with _written_lock:
        known, stamp = _written.pop(key, (None, None))
    read_at = time.monotonic()
    previous = known if known is not None else (read_record(record_loc, tolerate_corrupt=True) or Record())
    if dest.is_local or not previous.objects:
        # A folder or prefix is refused before anything is written (folders.py). A destination with a record
        # was saved to as an object before: on object stores that spares the first save a HEAD and a listing.
        refuse_folder_destination(dest)
    if previous.sweep or (known is None and dest.is_local):
        _log.logger.debug("sweeping leftovers of interrupted saves at %s", _log.safe_uri(dest.uri))
        dest.sweep_leftovers(started_before=time.time())  # what killed or failed saves left
    entry = ObjectRecord(kind=payload.kind, codec=codec.name if payload.archived else "raw",
                         save_id=uuid.uuid4().hex, created=time.time(), size=payload.size())
    state = _SaveState(previous)

    def on_partial() -> None:  # a multipart upload begins: if this process dies, the next save sweeps it
        if not state.partial:
            state.partial = True
            state.record = replace(state.record, sweep=True)
            record_loc.write_small(state.record.to_bytes(), action="save a checkpoint to")

    def before_commit(size: int, digest: str) -> None:
        # Another process may save here too: the record must keep listing the object it made visible. Read the
        # record again unless it cannot have changed (local: the same file as this process wrote; a record
        # read a moment ago), and keep what it lists besides what this process knew.
        base = state.record
        if (known is not None and not _unchanged(record_loc, stamp)) or \
                (known is None and time.monotonic() - read_at > _FRESH_SECONDS):
            base = _merged(read_record(record_loc, tolerate_corrupt=True), base)
        state.record = base.with_new(replace(entry, size=size, crc32=digest), sweep=state.partial)
        record_loc.write_small(state.record.to_bytes(), action="record the checkpoint at")

    try:
        size, digest = write_payload(dest, payload, codec, level, digest="crc32", size_hint=payload.size(),
                                     before_commit=before_commit, on_partial=on_partial)
    except BaseException:
        _mark_failed(record_loc, state.record)
        raise
    with _written_lock:
        _written[key] = (replace(state.record, confirmed=entry.save_id, sweep=False), _stamp(record_loc))
    return replace(entry, size=size, crc32=digest)


#: A record read this recently (seconds) is not read again just before the new object is listed in it.
_FRESH_SECONDS = 1.0


def _stamp(record_loc: Location) -> tuple[int, int, int] | None:
    """Local disk: what identifies the record file this process just wrote (inode, size, mtime)."""
    if not record_loc.is_local:
        return None
    try:
        st = os.stat(record_loc.path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _unchanged(record_loc: Location, stamp: tuple[int, int, int] | None) -> bool:
    """True when the record is still the one this process wrote (local disk: a stat, no read); elsewhere it
    cannot be known without reading it, so False."""
    return stamp is not None and _stamp(record_loc) == stamp


def _merged(current: Record | None, known: Record) -> Record:
    """The record as stored, plus the objects this process knew of that it no longer lists (newest first)."""
    if current is None:
        return known
    listed = {o.save_id for o in current.objects}
    extra = tuple(o for o in known.objects if o.save_id not in listed)
    return replace(current, objects=current.objects + extra, confirmed=known.confirmed or current.confirmed)


@dataclass
class _SaveState:
    """What one save has written to the record so far."""

    record: Record
    partial: bool = False


def _mark_failed(record_loc: Location, record: Record) -> None:
    """After a failed save: the record keeps every object it listed (the failed save's object may have become
    visible if only the answer was lost) and asks the next save to sweep what this one may have left."""
    with contextlib.suppress(Exception):  # best effort: the record already lists everything that may be visible
        record_loc.write_small(replace(record, sweep=True).to_bytes())


def read_record(record_loc: Location, *, tolerate_corrupt: bool = False) -> Record | None:
    """The record beside a checkpoint object, or None when there is none."""
    data = record_loc.read_small()
    if data is None:
        return None
    try:
        return Record.from_bytes(data, record_loc.uri)
    except CheckpointCorruptError:
        if tolerate_corrupt:
            return None
        raise


class _Unlisted(CheckpointCorruptError):
    """The object read is none of those the record lists (maybe a save that listed it has not been seen)."""


def load_object(src: Location, workspace: Path) -> Path | None:
    """Load the checkpoint at ``src`` into ``workspace``; None when nothing was ever saved there."""
    record_loc = src.sibling(MANIFEST_SUFFIX)
    record = read_record(record_loc)
    paused = False
    for reread in range(_RECORD_REREADS + 1):
        try:
            result = _load_listed(src, workspace, record)
            break
        except _Unlisted:
            # A save writes its record before its object becomes visible: a reader that meets an object its
            # copy of the record does not list finds it listed when it reads the record again (once more after
            # a short pause: two writers may race). A record that stays the same means the object is damaged.
            newer = read_record(record_loc)
            if reread == _RECORD_REREADS or (newer == record and paused):
                raise
            if newer == record:  # another writer may be about to make the object its record lists visible
                time.sleep(_RECORD_PAUSE)
                paused = True
            record = newer
    if result is None:
        if record is not None and record.objects:
            raise CheckpointCorruptError(
                f"the checkpoint at {src.uri} is recorded as saved but its object is missing; it was deleted "
                f"or moved. Restore the object, or delete its record ({MANIFEST_SUFFIX}) to start over.")
        if src.container_missing():
            raise StorageNotFound(f"could not load {src.uri}: the bucket or container does not exist. "
                                  "Create it, or fix the URI.")
    return result


def _load_listed(src: Location, workspace: Path, record: Record | None) -> Path | None:
    """One load of ``src``, verified against ``record`` (objects without a record are Flyte's: unverified)."""

    def choose(head: bytes, size: int | None) -> type[Payload]:
        if record is None:
            return guess_kind(head)
        listed = record.of_size(size) or record.unverified or record.of_size(None)
        if listed is None:
            raise _Unlisted(f"the checkpoint at {src.uri} has a record that lists no object")
        if size is not None and listed.size not in (None, size) and record.unverified is None:
            raise _Unlisted(f"the checkpoint at {src.uri} holds an object of {size} bytes, which its record "
                            "does not list")
        return payload_class(listed.kind, src.uri)

    def verify(kind: str, size: int, digest: str) -> None:
        _verify(record, kind, size, digest, src.uri)
        _log.note_verified(kind, size)

    newest = record.of_size(None) if record is not None else None
    digest = "sha256" if newest is not None and newest.crc32 is None and newest.sha256 else "crc32"
    return read_payload(src, workspace, choose, verify, digest, size_hint=newest.size if newest else None)


def _verify(record: Record | None, kind: str, size: int, digest: str, uri: str) -> None:
    if record is None or record.matching(kind, size, digest) is not None:
        return
    legacy = record.unverified
    if legacy is not None and legacy.kind == kind and legacy.size in (None, size):
        warnings.warn(
            f"the checkpoint at {uri} was written by a save (of an older taskpoint) that stopped before recording "
            "its checksum; it was loaded with the archive's own checks only.", stacklevel=2)
        return
    expected = ", ".join(str(o.size) for o in record.objects) or "none"
    raise _Unlisted(
        f"the checkpoint at {uri} does not match the checksum recorded when it was saved "
        f"(size {size}, recorded sizes {expected}); it is truncated or damaged. Save a new checkpoint, or load "
        "an older one.")
