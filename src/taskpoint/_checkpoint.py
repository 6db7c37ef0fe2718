"""BaseCheckpoint and Checkpoint: save progress to any fsspec location and load the previous attempt's."""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

import anyio.to_thread

from ._codecs import BLOCK_SIZE, Codec, detect_codec, get_codec
from ._manifest import MANIFEST_SUFFIX, Manifest, ObjectRecord
from ._payloads import BytesPayload, DirectoryPayload, Payload, payload_class, payload_for
from ._storage import Location, RetryPolicy, normalize_uri, permanent_error
from .errors import CheckpointCorruptError, CheckpointError, StorageError

_TEMPLATE = re.compile(r"\{\{.*?\}\}")
_HEAD_SIZE = 1024
_STAGING_PREFIX = ".taskpoint-staging-"


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
    streamed; loads are verified against the sha256 recorded at save time and extracted safely.

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
        self._workspace = _Workspace(workspace)

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
        return self._src is not None and self._src.exists()

    # -- save --------------------------------------------------------------------------------------------

    def save_sync(self, data: Any) -> None:
        payload = payload_for(data)
        with self._lock:
            self._check_open()
            save_object(self._dest, payload, self._codec, self._level)

    # -- load --------------------------------------------------------------------------------------------

    def load_sync(self) -> Path | None:
        with self._lock:
            self._check_open()
            if self._loaded is not None and self._loaded.exists():
                return self._loaded
            if self._src is None:
                return None
            result = load_object(self._src, self.path)
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


# -- the save and load procedures, shared with the versioned manager ------------------------------------


class _SourceFailure(Exception):
    """Reading the data to save failed (not storage): report the original error, do not retry."""


class _HashingWriter:
    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink
        self._hash = hashlib.sha256()
        self.size = 0
        self.failed = False

    def write(self, b: bytes) -> int:
        try:
            self._sink.write(b)
        except BaseException:
            self.failed = True
            raise
        self._hash.update(b)
        n = memoryview(b).nbytes
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _HashingReader:
    """Reads a storage stream, hashing every byte, with a peek at the head to pick the payload kind."""

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self._hash = hashlib.sha256()
        self._head = b""
        self.size = 0

    def peek_head(self, n: int) -> bytes:
        while len(self._head) < n:
            chunk = self._source.read(n - len(self._head))
            if not chunk:
                break
            self._head += chunk
        return self._head

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n < 0 or n >= len(self._head):
                data, self._head = self._head, b""
                if n < 0:
                    data += self._source.read()
            else:
                data, self._head = self._head[:n], self._head[n:]
        else:
            data = self._source.read(n)
        self._hash.update(data)
        self.size += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while self.read(BLOCK_SIZE):
            pass

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def save_object(dest: Location, payload: Payload, codec: Codec, level: int | None) -> ObjectRecord:
    """Write ``payload`` to ``dest`` atomically and record its kind and sha256 beside it."""
    record_loc = dest.sibling(MANIFEST_SUFFIX)
    previous = _read_manifest(record_loc, tolerate_corrupt=True)
    pending = ObjectRecord(kind=payload.kind, codec=codec.name if payload.archived else "raw",
                           save_id=uuid.uuid4().hex, created=time.time(), size=payload.size())
    committed_before = previous.committed if previous else None
    record_loc.write_small(Manifest(committed=committed_before, pending=pending).to_bytes(),
                           action="save a checkpoint to")

    def write() -> tuple[int, str]:
        with dest.open_write() as f:
            out = _HashingWriter(f)
            try:
                payload.write(out, codec, level)
            except BaseException as exc:
                if out.failed or not isinstance(exc, Exception):
                    raise
                raise _SourceFailure(exc) from exc
        return out.size, out.hexdigest()

    try:
        size, digest = dest.retry.call(write, action="save a checkpoint to", uri=dest.uri)
    except _SourceFailure as failure:
        _restore_manifest(record_loc, committed_before)
        raise failure.__cause__ from None  # type: ignore[misc]
    except (PermissionError, FileNotFoundError) as exc:
        _restore_manifest(record_loc, committed_before)
        raise permanent_error(exc, "save a checkpoint to", dest.uri) from exc
    except BaseException:
        _restore_manifest(record_loc, committed_before)
        raise
    record = ObjectRecord(kind=pending.kind, codec=pending.codec, save_id=pending.save_id,
                          created=pending.created, size=size, sha256=digest)
    try:
        record_loc.write_small(Manifest(committed=record).to_bytes(), action="record the checkpoint at")
    except StorageError as exc:
        raise StorageError(f"the checkpoint at {dest.uri} was written, but its record could not be updated "
                           f"({exc}); it will load without checksum verification. Save again to fix it.") from exc
    return record


def _restore_manifest(record_loc: Location, committed: ObjectRecord | None) -> None:
    try:
        if committed is None:
            record_loc.remove()
        else:
            record_loc.write_small(Manifest(committed=committed).to_bytes())
    except Exception:  # best effort: a leftover pending entry is harmless
        pass


def _read_manifest(record_loc: Location, *, tolerate_corrupt: bool = False) -> Manifest | None:
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
    manifest = _read_manifest(src.sibling(MANIFEST_SUFFIX))
    return src.retry.call(lambda: _load_once(src, workspace, manifest),
                          action="load the checkpoint from", uri=src.uri)


def _load_once(src: Location, workspace: Path, manifest: Manifest | None) -> Path | None:
    try:
        raw = src.open_read()
    except FileNotFoundError:
        if manifest is not None and manifest.committed is not None:
            raise CheckpointCorruptError(
                f"the checkpoint at {src.uri} is recorded as saved but its object is missing; it was deleted "
                "or moved. Restore the object, or delete the record to start over.") from None
        if src.container_missing():
            raise StorageError(f"could not load {src.uri}: the bucket or container does not exist. "
                               "Create it, or fix the URI.") from None
        return None
    with raw:
        reader = _HashingReader(raw)
        head = reader.peek_head(_HEAD_SIZE)
        record = _choose_record(manifest, _object_size(raw))
        cls = payload_class(record.kind, src.uri) if record else _guess_kind(head)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=workspace))
        try:
            if cls.archived:
                stream = detect_codec(head, src.uri).reader(reader)  # type: ignore[arg-type]
                try:
                    cls.materialize(stream, staging, src.uri)
                finally:
                    stream.close()
            else:
                cls.materialize(reader, staging, src.uri)  # type: ignore[arg-type]
            reader.drain()
            _verify(manifest, cls.kind, reader.size, reader.hexdigest(), src.uri)
            return cls.publish(staging, workspace)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _object_size(raw: IO[bytes]) -> int | None:
    size = getattr(raw, "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(raw.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        return None


def _choose_record(manifest: Manifest | None, size: int | None) -> ObjectRecord | None:
    if manifest is None:
        return None
    committed, pending = manifest.committed, manifest.pending
    if committed is not None and (pending is None or size == committed.size):
        return committed
    return pending or committed


def _guess_kind(head: bytes) -> type[Payload]:
    """Kind of an object with no record (written by Flyte or by hand): a tar archive is a directory."""
    import zlib

    probe = head
    if head.startswith(b"\x1f\x8b"):
        try:
            probe = zlib.decompressobj(wbits=31).decompress(head, 512)
        except zlib.error:
            return BytesPayload
    elif head.startswith(b"\x28\xb5\x2f\xfd"):
        return DirectoryPayload
    return DirectoryPayload if probe[257:262] == b"ustar" else BytesPayload


def _verify(manifest: Manifest | None, kind: str, size: int, digest: str, uri: str) -> None:
    if manifest is None:
        return
    committed, pending = manifest.committed, manifest.pending
    if committed is not None and committed.size == size and committed.sha256 == digest:
        return
    if pending is not None and pending.kind == kind and pending.size in (None, size):
        warnings.warn(
            f"the checkpoint at {uri} was written by a save that stopped before recording its checksum; "
            "it was loaded with the archive's own checks only.", stacklevel=4)
        return
    expected = committed.size if committed else None
    raise CheckpointCorruptError(
        f"the checkpoint at {uri} does not match the checksum recorded when it was saved "
        f"(size {size}, expected {expected}); it is truncated or damaged. Save a new checkpoint, or load "
        "an older one.")


class _Workspace:
    """The local folder of one Checkpoint: private temp folder, or one the caller chose."""

    _in_use: set[str] = set()
    _to_remove: set[str] = set()
    _guard = threading.Lock()
    _exit_hook = False

    def __init__(self, folder: str | os.PathLike[str] | None) -> None:
        if folder is None:
            self.path = Path(tempfile.mkdtemp(prefix="taskpoint-"))
            self.owned = True
        else:
            self.path = Path(normalize_uri(folder, "workspace")).absolute()
            self.path.mkdir(parents=True, exist_ok=True)
            self.owned = False
        key = str(self.path.resolve())
        with self._guard:
            if not _Workspace._exit_hook:
                atexit.register(_Workspace.remove_all)
                _Workspace._exit_hook = True
            if key in self._in_use:
                raise ValueError(f"workspace {self.path} is already used by another open Checkpoint")
            self._in_use.add(key)
            if self.owned:
                self._to_remove.add(key)
        self._key = key

    def close(self) -> None:
        with self._guard:
            self._in_use.discard(self._key)
            self._to_remove.discard(self._key)
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            for leftover in self.path.glob(_STAGING_PREFIX + "*"):
                shutil.rmtree(leftover, ignore_errors=True)

    @classmethod
    def remove_all(cls) -> None:
        with cls._guard:
            paths, cls._to_remove = list(cls._to_remove), set()
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


