"""Location: one object on an fsspec filesystem, with the operations a checkpoint needs.

A Location is a value: a URI, its storage options and a retry policy, with the filesystem and the backend
that fsspec and :mod:`~taskpoint.storage.clients` pick for it. Every operation runs through the retry
policy and the typed error map, so a caller sees a result, ``FileNotFoundError`` for an object that is
absent where absence has a meaning, or a :class:`~taskpoint.errors.StorageError` subclass. Every write
becomes visible whole or not at all (see the backends).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

import fsspec

from ..errors import StorageAccessDenied
from ._obstore import ObstoreS3Backend
from .backends import NO_HOOKS, Backend, Kind, WriteHooks, credential_source
from .clients import S3_CLIENT_OPTION, backend_for, client_timeouts, raised_by_credentials, s3_client, watched
from .deadline import NO_DEADLINE, Deadline
from .errormap import Failure, classify, describe, map_errors
from .localdisk import LocalBackend
from .objectstores import S3Backend
from .retry import RetryPolicy
from .uris import check_storage_options, check_uri, extra_for

T = TypeVar("T")


class Location:
    """One object (file) on an fsspec filesystem, with the operations a checkpoint needs."""

    #: The deadline of an operation this location's operations run inside (:meth:`within`): each ends by it.
    outer: Deadline = NO_DEADLINE

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None, *, options_checked: bool = False) -> None:
        """ValueError for a malformed URL and for an option its filesystem does not take; ``options_checked``:
        the caller checked them with :meth:`check_options`, over every location they serve."""
        options = dict(storage_options or {})
        if options.get("asynchronous"):
            raise ValueError("storage_options may not set asynchronous=True; taskpoint manages async itself")
        check_uri(uri)
        self.uri = uri
        self.storage_options = options
        self.retry = retry or RetryPolicy()
        scheme = uri.partition("://")[0] if "://" in uri else "file"
        if not options_checked:
            self.check_options([uri], options)
        client, fs_options = s3_client(scheme, options)
        try:
            # Some clients check credentials as they connect (gcsfs with token="google_default").
            with map_errors("connect to", uri, credential_source((scheme,), fs_options)):
                self.fs, self.path = fsspec.core.url_to_fs(uri, **watched(scheme, client_timeouts(
                    scheme, fs_options, self.retry.deadline)))
        except ImportError as exc:
            raise ImportError(f"{uri}: {exc}. To use {scheme}://, {extra_for(scheme.rpartition('::')[2])}.") from exc
        except (KeyError, ValueError, TypeError) as exc:
            if not raised_by_credentials(exc):
                raise
            raise StorageAccessDenied(
                f"could not connect to {uri}: the credentials could not be used ({describe(exc)}). taskpoint used "
                f"{credential_source((scheme,), options)}; check that they are complete and valid.") from exc
        self.backend: Backend = backend_for(self.fs, fs_options)
        if client == "obstore" and isinstance(self.backend, S3Backend):
            self.backend = ObstoreS3Backend(self.fs, fs_options, self.retry.deadline, self.retry.stall_timeout)
        self.backend.stall = self.retry.stall_timeout

    @staticmethod
    def check_options(uris: list[str], storage_options: dict[str, Any] | None) -> None:
        """ValueError naming each storage option that none of the filesystems of ``uris`` takes (one dict can
        serve a checkpoint's destination and its source, on two stores), with the closest valid name.
        taskpoint's own :data:`S3_CLIENT_OPTION` is valid anywhere."""
        options = {key: value for key, value in (storage_options or {}).items() if key != S3_CLIENT_OPTION}
        check_storage_options(uris, options)

    def _moved(self, uri: str, path: str) -> Location:
        other = object.__new__(Location)
        other.__dict__.update(self.__dict__)
        other.uri, other.path = uri, path
        return other

    def with_retry(self, retry: RetryPolicy) -> Location:
        """This location with another retry policy (a best-effort write that must not take a whole deadline)."""
        other = self._moved(self.uri, self.path)
        other.retry = retry
        return other

    def within(self, outer: Deadline) -> Location:
        """This location, its operations ending by ``outer`` too: the deadline of an operation that runs them
        (a write's hook that writes the record)."""
        other = self._moved(self.uri, self.path)
        other.outer = outer
        return other

    def sibling(self, suffix: str) -> Location:
        """The object whose name is this one's plus ``suffix`` (``ckpt`` -> ``ckpt.taskpoint.json``)."""
        return self._moved(self.uri + suffix, self.path + suffix)

    def child(self, relative: str) -> Location:
        """The object ``relative`` (``a/b``) below this location, taken as a folder."""
        relative = relative.strip("/")
        return self._moved(f"{self.uri.rstrip('/')}/{relative}", f"{self.path.rstrip('/')}/{relative}")

    def throttles(self) -> int:
        """Answers by which this location's store asked to slow down, so far in this process (every location
        of the store counts into one figure): a save's or load's log record reports how many came while it ran."""
        return self.backend.pushback.throttled

    @property
    def is_local(self) -> bool:
        """True on local disk, where transfers may use file descriptors and kernel copies."""
        return isinstance(self.backend, LocalBackend)

    def run(self, fn: Callable[[Deadline], T], *, action: str, writing: bool = False) -> T:
        """``fn(deadline)`` with this location's retries and error map (for transfers that span several calls);
        ``deadline``, the attempt's, is for ``fn`` to pass to :meth:`open_read` and :meth:`open_write`.
        ``writing``: ``fn`` writes here, so "not found" means a missing bucket, container or folder, unless the
        bucket is there: then the store lost something of the write in flight (GCS forgets a resumable upload
        session that a fault interrupted), and the write is retried."""
        call = fn
        if writing and not self.is_local:
            def call(deadline: Deadline) -> T:
                try:
                    return fn(deadline)
                except FileNotFoundError as exc:
                    if classify(exc) is Failure.ABSENT and not self.backend.container_missing(self.path):
                        raise LostInFlight(errno.EAGAIN, f"the store lost part of the write to {self.uri}") from exc
                    raise
        with map_errors(action, self.uri, self.backend.credentials(), writing=writing):
            return self.retry.call(call, action=action, uri=self.uri, endpoint=self.backend.endpoint(),
                                   outer=self.outer, pushback=self.backend.pushback,
                                   count=not self.backend.answers_watched)

    # -- reads -------------------------------------------------------------------------------------------

    def _absent_as(self, absent: T, read: Callable[[Backend], T], *, action: str) -> T:
        """``read(backend)`` with this location's retries and error map; ``absent`` when nothing is there, or a
        parent is a file."""
        def attempt(deadline: Deadline) -> T:
            try:
                return read(self.backend.within(deadline))
            except (FileNotFoundError, NotADirectoryError):
                return absent
        return self.run(attempt, action=action)

    def exists(self) -> bool:
        """True when an object is here (a folder or prefix is not one). Only "not found" is False: a location
        that cannot be read (denied, I/O error, stale handle, outage) raises the matching StorageError."""
        return self.run(lambda d: self.backend.within(d).exists(self.path), action="check")

    def size(self) -> int | None:
        """The size of the object here, None when there is none (a folder or prefix is none). A location that
        cannot be read raises the matching StorageError."""
        return self.run(lambda d: self.backend.within(d).size(self.path), action="check")

    def kind(self) -> Kind:
        """What is here: an object, a folder (local) or a prefix with objects under it, or nothing. Only "not
        found" is :attr:`Kind.NOTHING`; a location that cannot be read raises the matching StorageError."""
        return self.run(lambda d: self.backend.within(d).kind(self.path.rstrip("/") or self.path), action="check")

    def read_small(self) -> bytes | None:
        """The whole object, or None when it does not exist (nor its bucket: callers that must tell the two
        apart ask :meth:`container_missing`). For manifests, not payloads."""
        return self._absent_as(None, lambda backend: backend.read_small(self.path), action="read")

    def read_versioned(self) -> tuple[bytes | None, str | None]:
        """:meth:`read_small` with the object's version, for :meth:`write_versioned` (None where the store has
        no conditional writes, or nothing is there)."""
        nothing: tuple[bytes | None, str | None] = (None, None)
        return self._absent_as(nothing, lambda backend: backend.read_versioned(self.path), action="read")

    @property
    def conditional(self) -> bool:
        """True where writes can be conditional on the version read (S3's ETag, GCS's generation)."""
        return self.backend.conditional

    def write_versioned(self, data: bytes, expected: str | None, *, action: str = "write") -> str | None:
        """Where :attr:`conditional`: write ``data`` only if the object is still at version ``expected`` (None:
        only if nothing is there), with retries, and return the new version; ``VersionConflict`` when another
        writer changed it (a retry whose first try landed but lost its answer also meets it: read again). Where
        not, a plain atomic write that returns None. For records, not payloads."""
        return self.run(lambda d: self.backend.within(d).write_versioned(self.path, data, expected), action=action,
                        writing=True)

    def open_read(self, size_hint: int | None = None, deadline: Deadline = NO_DEADLINE) -> IO[bytes]:
        """A streaming reader; FileNotFoundError when the object does not exist. ``size_hint``, the size the
        caller expects, lets a small remote object come down in one request. Not retried here: call it
        inside :meth:`run`, with its ``deadline``, which bounds the reader's requests (also those it makes on
        pool threads)."""
        return self.backend.within(deadline).open_read(self.path, size_hint)

    def read_range(self, start: int, length: int) -> bytes:
        """``length`` bytes of the object from ``start`` (fewer only past its end), with retries: what a partial
        restore reads of an archive's members. FileNotFoundError when the object is missing."""
        return self.run(lambda d: self.backend.within(d).read_range(self.path, start, length), action="read")

    def list_tree(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Every object and folder below this location, with listing details; {} when there is none. With
        ``prefix``, only what lies under the entries whose names start with it (``ckpt-``: a manager's steps,
        not its chunk store)."""
        return self._absent_as({}, lambda backend: backend.list_tree(self.path.rstrip("/"), prefix), action="list")

    def list_names(self) -> list[str]:
        """The names of the entries directly below this location; [] when there is none."""
        return self._absent_as([], lambda backend: backend.list_names(self.path), action="list")

    def container_missing(self) -> bool:
        """True when this object's bucket or container definitely does not exist (object stores only).

        False when the bucket may not be inspected (a role allowed to read objects but not to look at the bucket
        is common); an outage or any other failure raises: it never answers "the bucket is there"."""
        try:
            return self.run(lambda d: self.backend.within(d).container_missing(self.path), action="check")
        except StorageAccessDenied:
            return False

    # -- writes ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def open_write(self, size_hint: int | None = None, hooks: WriteHooks = NO_HOOKS,
                   deadline: Deadline = NO_DEADLINE) -> Iterator[IO[bytes]]:
        """A writer whose bytes appear at this location all at once when the block exits cleanly.

        If the block raises, or the process dies, the previous object (if any) is left untouched.
        ``size_hint`` (the size when known in advance) lets small objects go up as one request; ``hooks``
        run just before the object becomes visible and when a killed writer could leave parts behind, and are
        given ``deadline``. Not retried here: call it inside :meth:`run`, with its ``deadline``, which bounds
        the writer's requests (S3's parts on pool threads too) and those of the hooks.
        """
        with self.backend.within(deadline).open_write(self.path, size_hint, hooks) as f:
            yield f

    def write_small(self, data: bytes, *, action: str = "write", create: bool = False) -> None:
        """Write ``data`` atomically, with retries. For manifests, not payloads. ``create``: only where no object
        is, where the store has conditional writes (:meth:`write_versioned` of no version: ``VersionConflict``
        when there is one, also when a retry meets the first try's landed write); elsewhere a plain write."""
        if create and self.conditional:
            self.write_versioned(data, None, action=action)
            return

        def write(deadline: Deadline) -> None:
            with self.open_write(len(data), deadline=deadline) as f:
                f.write(data)
        self.run(write, action=action, writing=True)

    def remove(self) -> None:
        """Delete the object; a missing object is fine."""
        def rm(deadline: Deadline) -> None:
            with contextlib.suppress(FileNotFoundError):
                self.backend.within(deadline).remove(self.path)
        self.run(rm, action="delete")

    def remove_tree(self) -> None:
        """Delete this folder and everything below it; a missing folder is fine."""
        def rm(deadline: Deadline) -> None:
            with contextlib.suppress(FileNotFoundError):
                self.backend.within(deadline).remove_tree(self.path)
        self.run(rm, action="delete")

    def remove_empty_folder(self) -> None:
        """Remove this location if it is an empty folder. Best effort: a folder that is not empty stays."""
        with contextlib.suppress(Exception):
            self.backend.remove_empty_folder(self.path.rstrip("/"))

    # -- leftovers of killed saves -----------------------------------------------------------------------

    def sweep_leftovers(self, started_before: float) -> None:
        """Remove what killed saves of this object left: temp files (local) and unfinished uploads (S3).

        Best effort: see the backends for what each store can see and when it is old enough to go.
        """
        with contextlib.suppress(Exception):
            self.backend.sweep_leftovers(self.path, started_before)

    def unfinished_uploads(self) -> list[tuple[str, str, float]]:
        """S3 only: the multipart uploads begun under this location's path (as a prefix) and never completed
        or aborted, as (key, upload id, initiation time); [] elsewhere. Not retried: callers sweep best-effort."""
        return self.backend.unfinished_uploads(self.path)

    def abort_upload(self, key: str, upload_id: str) -> None:
        """S3 only: abort one unfinished multipart upload in this location's bucket."""
        self.backend.abort_upload(self.path, key, upload_id)


class LostInFlight(OSError):
    """A write's upload session or part vanished while its bucket is there: transient, retried."""


def normalize_uri(value: str | os.PathLike[str], what: str) -> str:
    """A URI string from a str or PathLike; a TypeError names ``what`` for anything else."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str URI or an os.PathLike, not {type(value).__name__}")
    return value
