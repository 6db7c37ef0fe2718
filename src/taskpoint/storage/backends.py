"""What every backend does, and the base class: how one kind of store does an atomic write, a streaming read, an
existence check.

Backends take paths of their filesystem and raise what the client raises; the :class:`~taskpoint.storage.Location`
above them retries and maps errors, and picks one by the filesystem's class (:func:`.clients.backend_for`). Here:
:class:`Backend` and :class:`MovingBackend` (``memory://`` and any other filesystem); local disk's is in
:mod:`.localdisk`, the object stores' in :mod:`.objectstores` and :mod:`._obstore`, each class saying how it writes.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import io
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any, ClassVar, TypeVar

from .deadline import NO_DEADLINE, Deadline, bounded
from .errormap import Failure, classify
from .stalls import STALL_TIMEOUT
from .streams import RANGE_SIZE
from .throttle import pushback_for, store_key

#: Read-ahead blocks of remote streams, and the block size of client uploads.
PART_SIZE = 16 << 20
#: Objects expected to be at most this large are read with one request.
SMALL_READ = 2 * RANGE_SIZE
#: Age after which a temp object or unfinished upload of a killed save is swept by a later save. A writer
#: that is still alive keeps touching its temp file, so this never disturbs a concurrent save.
LEFTOVER_GRACE_SECONDS = 15 * 60
#: Protocols of object stores whose writers upload in parts and can abort them (``discard``).
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


class WholeObject(io.BytesIO):
    """An object read whole, as a stream that knows its size."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.size = len(data)


def _nothing(deadline: Deadline) -> None:
    return None


@dataclass(frozen=True)
class WriteHooks:
    """What a writer's caller wants to do at two moments of an atomic write; each is given the write's
    deadline, for the storage calls it makes."""

    #: Every byte is written and durable, none is visible yet (before the rename, PUT or completion).
    before_commit: Callable[[Deadline], None] = _nothing
    #: Something that a killed process would leave behind is about to exist (an S3 multipart upload).
    on_partial: Callable[[Deadline], None] = _nothing


NO_HOOKS = WriteHooks()


class Kind(enum.Enum):
    """What a location holds: an object (a file), a folder (local) or prefix with objects under it, nothing."""

    OBJECT = "object"
    FOLDER = "folder"
    NOTHING = "nothing"


#: errno values that mean "not there" (the path, or a parent that is a file): the only absence. Anything else
#: (EACCES, EIO, ESTALE on NFS or Lustre) is an error, never "nothing here".
ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})


def _is_absent(exc: OSError) -> bool:
    return isinstance(exc, (FileNotFoundError, NotADirectoryError)) or exc.errno in ABSENT_ERRNOS


def folder_error(path: str) -> IsADirectoryError:
    """The error of a read of a folder or prefix as if it were one object (a load turns it into a folder load)."""
    return IsADirectoryError(errno.EISDIR, "a folder, not an object", path)


def protocols(fs: Any) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def modified_time(info: dict[str, Any]) -> float | None:
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


B = TypeVar("B", bound="Backend")


class Backend:
    """The operations of one kind of store on paths of its filesystem ``fs``; their client calls are bounded by
    :attr:`deadline` (:meth:`within` gives the view of a retried operation's attempt)."""

    #: Another process can write here with the same URI and options (the manager's save process).
    shared: bool = True
    #: The store has real folders (removed when empty) rather than key prefixes.
    has_folders: ClassVar[bool] = True

    #: The client reports each answer of the store to :attr:`pushback` (throttling answers its own retries
    #: absorb are counted there); where not, the retry policy counts those that reach it.
    answers_watched: ClassVar[bool] = False

    #: The deadline of the operation this view serves: client calls get the time left before it.
    deadline: Deadline = NO_DEADLINE
    #: Seconds after which a part or ranged read that made no progress is sent again (the location's
    #: ``RetryPolicy.stall_timeout``, :mod:`.stalls`).
    stall: float = STALL_TIMEOUT

    def __init__(self, fs: Any, options: dict[str, Any]) -> None:
        self.fs = fs
        self.options = options
        #: What this store said about its load (throttling answers, the cap on requests in flight), named by the
        #: store's :meth:`endpoint`.
        self.pushback = pushback_for(store_key(self.endpoint(), protocols(fs)[0]))

    def within(self: B, deadline: Deadline) -> B:
        """This backend with its calls, and the readers and writers it opens, bounded by ``deadline`` (a
        shallow copy that shares the client and its caches: about a microsecond)."""
        if deadline is self.deadline:
            return self
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.deadline = deadline
        return view

    def credentials(self) -> str | None:
        """Which credentials this store uses, in words (never their values); None where none apply."""
        return credential_source(protocols(self.fs), self.options)

    def endpoint(self) -> str | None:
        """The URL of the server this store's client talks to, where it was given or the client makes one (Azure's
        account URL); None: the client's own."""
        return None

    def kind(self, path: str) -> Kind:
        """What ``path`` holds. Only "not found" is :attr:`Kind.NOTHING`; any other failure is raised."""
        found = self._info(path).get("type")
        return Kind.OBJECT if found == "file" else Kind.FOLDER if found == "directory" else Kind.NOTHING

    def _info(self, path: str) -> dict[str, Any]:
        """``path``'s listing details, fresh; {} when it is not found."""
        # Not fs.isfile() or fs.exists(): they answer False for any error, which would report an outage or a
        # denial as "nothing here".
        self.fs.invalidate_cache(path)
        try:
            return self.fs.info(path, **bounded(self.fs, self.deadline))  # type: ignore[no-any-return]
        except FileNotFoundError as exc:
            if classify(exc) is Failure.NO_CONTAINER:
                raise  # no bucket is no "nothing here": the error map makes it StorageNotFound
            return {}

    def exists(self, path: str) -> bool:
        """True when ``path`` is an object (a folder or prefix is not); errors other than "not found" raise."""
        return self.kind(path) is Kind.OBJECT

    def size(self, path: str) -> int | None:
        """The size of the object at ``path``, None when there is none; errors other than "not found" raise."""
        info = self._info(path)
        return int(info["size"]) if info.get("type") == "file" else None

    def read_small(self, path: str) -> bytes:
        self.fs.invalidate_cache(path)
        return self.fs.cat_file(path, **bounded(self.fs, self.deadline))  # type: ignore[no-any-return]

    #: Writes can be made conditional on the version read (:meth:`read_versioned`, :meth:`write_versioned`).
    conditional: ClassVar[bool] = False

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """The whole object and its version (None where the store has no conditional writes)."""
        return self.read_small(path), None

    def write_versioned(self, path: str, data: bytes, expected: str | None) -> str | None:
        """Where :attr:`conditional`: write ``data`` only if the object is still at version ``expected`` (None:
        only if there is none), returning the new version, else raise ``VersionConflict``. Elsewhere an atomic
        write that returns None."""
        with self.open_write(path, len(data), NO_HOOKS) as f:
            f.write(data)
        return None

    def open_read(self, path: str, size_hint: int | None = None) -> IO[bytes]:
        self.fs.invalidate_cache(path)
        try:
            return self.fs.open(path, "rb", block_size=PART_SIZE, cache_type="readahead")  # type: ignore[no-any-return]
        except FileNotFoundError:
            if self.kind(path) is Kind.FOLDER:  # keys under path/ but none at path (memory://)
                raise folder_error(path) from None
            raise

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of the object at ``path`` from ``start`` (fewer only past its end): one ranged GET."""
        if length <= 0:
            return b""
        return self.fs.cat_file(path, start=start, end=start + length, **bounded(self.fs, self.deadline))  # type: ignore[no-any-return]

    def open_write(self, path: str, size_hint: int | None, hooks: WriteHooks
                   ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """An atomic writer; ``hooks.before_commit`` runs when every byte is written and none is visible yet."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        self.fs.rm_file(path, **bounded(self.fs, self.deadline))

    def remove_tree(self, path: str) -> None:
        """Remove the folder ``path`` and everything below it (on object stores: every key under the prefix)."""
        self.fs.rm(path, recursive=True, **bounded(self.fs, self.deadline))

    def list_tree(self, path: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Every object and folder below ``path`` with its listing details, only those whose path below ``path``
        starts with ``prefix`` when one is given (object stores filter on the server); FileNotFoundError when
        there is none."""
        self.fs.invalidate_cache(path)
        found = self.fs.find(path, withdirs=True, detail=True, **self._prefixed(prefix),
                             **bounded(self.fs, self.deadline))
        if not isinstance(found, dict):
            return {}
        if prefix:
            start = self.fs._strip_protocol(path).rstrip("/") + "/" + prefix
            found = {name: info for name, info in found.items() if name.startswith(start)}
        return found

    def _prefixed(self, prefix: str) -> dict[str, str]:
        """The ``prefix=`` of this client's ``find`` (none: filtered after the listing)."""
        return {}

    def list_names(self, path: str) -> list[str]:
        """The names directly inside ``path``; FileNotFoundError when it does not exist."""
        self.fs.invalidate_cache(path)
        names = self.fs.ls(path, detail=False, **bounded(self.fs, self.deadline))
        return [str(name).rstrip("/").rsplit("/", 1)[-1] for name in names]

    def remove_empty_folder(self, path: str) -> None:
        """Remove the folder ``path`` if it is empty (stores without folders: nothing to do)."""
        if self.has_folders:
            self.fs.rmdir(path)

    def container_missing(self, path: str) -> bool:
        """True when ``path``'s bucket or container definitely does not exist (stores without them: False)."""
        return False

    def sweep_leftovers(self, path: str, started_before: float) -> None:
        """Remove what killed saves of ``path`` left, where this store can see it."""

    def unfinished_uploads(self, path: str) -> list[tuple[str, str, float]]:
        """Uploads begun under ``path`` and never completed, as (key, upload id, initiation time)."""
        return []

    def abort_upload(self, path: str, key: str, upload_id: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no unfinished uploads to abort")


class MovingBackend(Backend):
    """Any other filesystem (``memory://``, ...): write a temp object beside the destination, then move it."""

    def __init__(self, fs: Any, options: dict[str, Any]) -> None:
        super().__init__(fs, options)
        self.shared = "memory" not in protocols(fs)  # a memory filesystem lives in one process

    @contextlib.contextmanager
    def open_write(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Iterator[IO[bytes]]:
        tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
        parent = self.fs._parent(path)
        if parent:
            with contextlib.suppress(Exception):
                self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            hooks.before_commit(self.deadline)
            self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise
        finally:
            self.fs.invalidate_cache(path)


def credential_source(names: tuple[str, ...], options: dict[str, Any]) -> str | None:
    """Which credentials a store of these protocols uses with these options, in words: for messages that must
    say what was tried without ever showing a key. None for local disk and memory."""
    found = set(names)
    if found & {"file", "local", "memory"}:
        return None
    if options.get("anon") or options.get("token") == "anon":
        return "anonymous access (anon=True or token='anon' in storage_options)"
    if found & {"s3", "s3a"}:
        if options.get("key") or options.get("secret"):
            return "the key and secret given in storage_options"
        if options.get("profile"):
            return "the AWS profile named in storage_options"
        return ("botocore's default chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                "~/.aws/credentials, then an instance or pod role)")
    if found & {"gs", "gcs"}:
        if options.get("token") in (None, "google_default", "cloud"):
            return ("Google application default credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, "
                    "then the metadata server)")
        return "the token given in storage_options"
    if found & {"az", "abfs", "abfss", "adl"}:
        for key, words in (("connection_string", "the connection string"), ("account_key", "the account key"),
                           ("sas_token", "the SAS token"), ("credential", "the credential object")):
            if options.get(key):
                return f"{words} given in storage_options"
        return "the AZURE_STORAGE_* environment variables, then azure-identity's DefaultAzureCredential"
    return "the credentials in storage_options and the environment"
