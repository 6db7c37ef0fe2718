"""BaseCheckpoint and Checkpoint: save progress to any fsspec location and load the previous attempt's."""

from __future__ import annotations

import functools
import io
import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio.to_thread
from fsspec.callbacks import Callback

from . import _log, _progress
from .errors import CheckpointCorruptError, CheckpointError
from .folders import load_folder, source_exists
from .format.codecs import Codec, get_codec
from .format.index import normalize_path, normalize_paths
from .format.records import RECORD_SUFFIX
from .inspection import CheckpointDescription, CheckpointVerification, describe_object, verify_object
from .partial import listed_index, open_by_restoring, open_indexed, restore_indexed
from .payloads import payload_for
from .record import VERIFY_MODES, load_object, read_record, save_object, unverified
from .save_memory import SaveMemory
from .storage import Location, RetryPolicy, normalize_uri
from .transfer import SourceIsFolder
from .workspace import Workspace

__all__ = ["BaseCheckpoint", "Checkpoint", "CheckpointDescription", "CheckpointVerification", "clean_source_uri",
           "load_object", "read_record", "save_object"]

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
        max_expand: the most bytes a load may write into :attr:`path` (a directory's files added up); a
            checkpoint that would expand to more stops with :class:`~taskpoint.StorageFull` before writing
            past it. None (default): only the free space of the local disk limits a load (and
            ``taskpoint.format.extract.MAX_EXPAND`` where set).
        verify: what a load does with an object that has no record beside it (``<src>.taskpoint.json``), whose
            bytes nothing can verify: one written by Flyte or another tool, or whose record was removed.
            ``"warn"`` (default) loads it with the archive's own checks and logs a WARNING naming the URI;
            ``"strict"`` raises :class:`~taskpoint.CheckpointCorruptError` instead. A folder source (flytekit
            1.x's layout) has no record either, and is treated the same.
        copy_of: where ``checkpoint_src`` was copied from without its record (Flyte's local retries copy only
            the object, see docs/guides/platforms.md). When the source has no record of its own, the record
            beside ``copy_of`` verifies it if it lists those bytes; otherwise the source loads as one without a
            record (``verify=``).
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
        max_expand: int | None = None,
        verify: str = "warn",
        copy_of: str | os.PathLike[str] | None = None,
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
        if max_expand is not None and (not isinstance(max_expand, int) or isinstance(max_expand, bool)):
            raise TypeError(f"max_expand must be a number of bytes (an int) or None, not {type(max_expand).__name__}")
        if max_expand is not None and max_expand < 0:
            raise ValueError(f"max_expand must be at least 0 bytes, got {max_expand}")
        self._max_expand = max_expand
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(map(repr, VERIFY_MODES))}, got {verify!r}")
        self._strict = verify == "strict"
        self._retry = retry or RetryPolicy()
        source = clean_source_uri(checkpoint_src)
        original = clean_source_uri(copy_of) if source is not None else None
        # One dict of options serves all: an option is refused only when no store takes it.
        Location.check_options([u for u in (dest, source, original) if u is not None], storage_options)
        self._dest = Location(dest, storage_options, self._retry, options_checked=True)
        self._src = Location(source, storage_options, self._retry, options_checked=True) if source is not None \
            else None
        self._copy_of = Location(original, storage_options, self._retry, options_checked=True) \
            if original is not None else None
        self._lock = threading.Lock()
        self._memory = SaveMemory()  # what this checkpoint's saves learned of its destination
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

    async def load(self, paths: Iterable[str] | None = None, *, progress: bool | Callback | None = None
                   ) -> Path | None:
        return await anyio.to_thread.run_sync(functools.partial(self.load_sync, paths, progress=progress))

    async def save(self, data: Any, *, progress: bool | Callback | None = None) -> None:
        await anyio.to_thread.run_sync(functools.partial(self.save_sync, data, progress=progress))

    async def prev_exists_async(self) -> bool:
        """Async twin of :meth:`prev_exists`."""
        return await anyio.to_thread.run_sync(self.prev_exists)

    # -- existence ---------------------------------------------------------------------------------------

    def prev_exists(self) -> bool:
        self._check_open()
        return self._src is not None and source_exists(self._src)  # an object, or a folder (folders.py)

    # -- save --------------------------------------------------------------------------------------------

    def save_sync(self, data: Any, *, progress: bool | Callback | None = None) -> None:
        """Save ``data``. ``progress``: True shows a bar, False nothing, an ``fsspec.callbacks.Callback`` is
        told the total and each step; None (the default) shows a bar on a terminal for saves longer than
        about two seconds (see docs/checkpoint.md, "Progress")."""
        clock = _log.Clock(self._dest.throttles)
        tracker = _progress.resolve(progress, f"save {_log.short_name(self._dest.uri)}")
        payload = payload_for(data)
        with self._lock, tracker:
            self._check_open()
            saved = save_object(self._dest, payload, self._codec, self._level, tracker, self._memory)
        _log.transferred("save", self._dest.uri, saved.kind, saved.size, clock)

    # -- load --------------------------------------------------------------------------------------------

    def load_sync(self, paths: Iterable[str] | None = None, *, progress: bool | Callback | None = None
                  ) -> Path | None:
        """Load the previous checkpoint; ``progress`` as for :meth:`save_sync` (a load counts stored bytes).

        ``paths`` (files or folders relative to the saved directory) loads only those into :attr:`path`: with
        the archive's index recorded at save, by ranged reads of the gzip members that hold them (each checked
        against its CRC32 and size); without one (saved by Flyte or an older taskpoint), by streaming the
        archive and keeping those entries. KeyError names a path the checkpoint lacks."""
        _progress.check(progress)
        if paths is not None:
            return self._load_paths(normalize_paths(paths), progress)
        with self._lock:
            self._check_open()
            if self._loaded is not None and self._loaded.exists():
                return self._loaded
            if self._src is None:
                return None
            clock = _log.Clock(self._src.throttles)
            verified: list[tuple[str, int]] = [("unknown", 0)]  # a folder load has no verified read to name
            with _progress.resolve(progress, f"load {_log.short_name(self._src.uri)}") as tracker:
                try:
                    result = load_object(self._src, self.path, tracker, strict=self._strict,
                                         copy_of=self._copy_of, max_expand=self._max_expand,
                                         on_verified=lambda kind, size: verified.append((kind, size)), clock=clock)
                except SourceIsFolder:  # a folder or prefix (flytekit 1.x's layout): a directory checkpoint
                    if self._strict:
                        raise CheckpointCorruptError(unverified(self._src.uri, strict=True)) from None
                    tracker.rewind()
                    result = load_folder(self._src, self.path, tracker)
                    _log.logger.warning(unverified(_log.safe_uri(self._src.uri), strict=False))
            if result is not None:
                _log.transferred("load", self._src.uri, *verified[-1], clock)
            self._loaded = result
            return result

    def _load_paths(self, paths: list[str], progress: bool | Callback | None) -> Path | None:
        with self._lock:
            self._check_open()
            if self._src is None:
                return None
            src = self._src
            index = listed_index(read_record(src.sibling(RECORD_SUFFIX)), src.size())
            with _progress.resolve(progress, f"load {_log.short_name(src.uri)}") as tracker:
                if index is not None:
                    return restore_indexed(src, index, paths, self.path, max_expand=self._max_expand,
                                           progress=tracker)
                try:
                    return load_object(src, self.path, tracker, strict=self._strict, copy_of=self._copy_of,
                                       max_expand=self._max_expand, only=paths)
                except SourceIsFolder:
                    raise CheckpointError(f"{src.uri} is a folder (flytekit 1.x's layout), whose files load whole; "
                                          "load it without paths=") from None

    def open(self, path: str) -> io.BufferedReader:
        """A read-only binary file (``read``, ``readinto``, ``seek``, ``tell``) of the file ``path`` of the previous
        checkpoint, read on demand: only the gzip members that hold the bytes asked for are fetched, each checked
        against its CRC32 and size before its bytes are returned, so ``torch.load(cp.open("model.pt"))`` needs no
        full load. Without an index the file is loaded alone into a temporary folder first. KeyError when the
        checkpoint has no such file; FileNotFoundError when there is no previous checkpoint."""
        self._check_open()
        src = self._src
        if src is None:
            raise FileNotFoundError("this checkpoint has no previous checkpoint (checkpoint_src)")
        index = listed_index(read_record(src.sibling(RECORD_SUFFIX)), src.size())
        if index is not None:
            return open_indexed(src, index, path)

        def restore(folder: Path) -> Path:
            found = load_object(src, folder, strict=self._strict, copy_of=self._copy_of, only=[normalize_path(path)])
            if found is None:
                raise FileNotFoundError(f"there is no checkpoint at {src.uri}")
            return found

        return open_by_restoring(restore, normalize_path(path))

    def verify(self, *, source: bool = False, progress: bool | Callback | None = None) -> CheckpointVerification:
        """Read every byte of the checkpoint this one saved (``source=True``: the previous attempt's) against
        the checksum its record lists, extracting nothing; one without a record is loaded into a temporary
        folder with the archive's own checks. CheckpointCorruptError when damaged (or recorded but missing),
        FileNotFoundError when nothing is there."""
        return verify_object(self._location(source), progress)

    def describe(self, *, source: bool = False) -> CheckpointDescription:
        """The checkpoint this one saved (``source=True``: the previous attempt's) and its record, read
        without the payload; FileNotFoundError when neither is there."""
        return describe_object(self._location(source))

    def _location(self, source: bool) -> Location:
        if not source:
            return self._dest
        if self._src is None:
            raise FileNotFoundError("this checkpoint has no previous checkpoint (checkpoint_src)")
        return self._src


def clean_source_uri(value: str | os.PathLike[str] | None) -> str | None:
    """The previous-checkpoint URI with whitespace and quotes stripped; None when empty or a template."""
    if value is None:
        return None
    text = normalize_uri(value, "checkpoint_src").strip().strip("'\"").strip()
    if not text or _TEMPLATE.search(text):
        return None
    return text
