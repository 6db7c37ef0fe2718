"""S3 through obstore (Rust's ``object_store``): the fast path for the bytes of ``s3://`` checkpoints.

Chosen with ``storage_options={"s3_client": "obstore"}`` or ``TASKPOINT_S3_CLIENT=obstore`` (extra
``taskpoint[obstore]``). obstore moves every byte of the data path: atomic writes (one PUT, or a multipart
upload aborted on failure), conditional record writes on the ETag, and reads (one GET for small objects,
ranged GETs in parallel pinned to the ETag for large ones). A 1 GiB save costs 58% less client CPU than
on s3fs, at a lower wall time (docs/performance.md). What carries no bytes stays on s3fs, whose filesystem
the :class:`~taskpoint.storage.Location` holds anyway: listings, ``kind``, deletes, the bucket check, and the
listing and aborting of unfinished multipart uploads, which obstore's Python API does not offer.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import io
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from . import _s3
from ._s3 import PARTS_IN_FLIGHT, RECEIVED_PIECE, SINGLE_PUT_MAX, UPLOAD_PART_SIZE
from .backends import SMALL_READ, Kind, WholeObject, WriteHooks, folder_error
from .deadline import Deadline
from .errormap import Failure, classify, code_and_status, is_transient
from .objectstores import S3Backend
from .retry import CLIENT_TIMEOUT
from .stalls import STALL_TIMEOUT, TransferFailed
from .streams import ConcurrentRangeReader, ObjectChanged, VersionConflict

#: Part size when the size is not known in advance (a compressed payload): 16 MiB parts reach 156 GiB in
#: S3's 10,000 parts. obstore's writer cannot grow its parts as an upload goes on, as taskpoint's s3fs writer
#: does.
UNKNOWN_SIZE_PART = 16 << 20
#: Parts an upload of known size is planned to fit in (below S3's 10,000); the least part size and the
#: largest single PUT, the parts in flight and the progress piece are the s3fs writer's (:mod:`._s3`).
MAX_PARTS = 9000
#: Retries obstore makes of one request of a large transfer itself (a part of a multipart upload, a ranged GET:
#: 5xx, dropped connections), within the operation's deadline; taskpoint's :class:`~taskpoint.storage.RetryPolicy`
#: retries whole operations above that. Those retries are invisible to taskpoint and ignore ``Retry-After``
#: (object_store 0.12 reads no header of a failed answer; measured through the fault proxy: a 503 that asked for
#: 1 s was sent again after 0.10-0.25 s), and its errors carry the status and body but no header. So the requests
#: that are a whole operation (records, small objects of up to ``SMALL_READ``: one GET, one HEAD, one PUT) go
#: through a store with no retries of its own: each throttling answer reaches the retry policy, which counts it
#: into the store's pushback (the save's log record) and paces as that pushback says, no shorter than a
#: ``Retry-After`` the store gave its s3fs requests. A large transfer keeps obstore's retries: retrying it whole
#: for one throttled part would start a 1 GiB upload over at every tenth request of a store that throttles that
#: many.
CLIENT_RETRIES = 3
#: Overall time limit of one request when the operation has no deadline.
REQUEST_TIMEOUT = 3600.0
#: The part's number in the URL of a request of a multipart upload (in obstore's error messages).
_PART_NUMBER = re.compile(r"[?&]partNumber=(\d+)")
#: What to install when the option names obstore and it is missing.
INSTALL_HINT = 'pip install "taskpoint[obstore]"'


def require_obstore() -> None:
    """Raise an ImportError that says what to install when obstore is not importable."""
    try:
        import obstore  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"s3_client='obstore' needs the obstore package: {INSTALL_HINT}") from exc


def store_config(options: dict[str, Any], deadline: float | None, stall: float = STALL_TIMEOUT) -> dict[str, Any]:
    """obstore's ``S3Store`` keyword arguments (all but the bucket) from the storage options users give s3fs:
    ``key``, ``secret``, ``token``, ``anon``, ``endpoint_url`` (or ``client_kwargs["endpoint_url"]``) and
    ``client_kwargs["region_name"]``, ``config_kwargs={"s3": {"payload_signing_enabled": False}}``; what is not
    given comes from the AWS_* environment variables (not from ~/.aws files or profiles). Timeouts
    follow the s3fs path: connect timeout of :data:`CLIENT_TIMEOUT`, lowered to a shorter deadline; no single
    request lasts longer than the deadline. The read timeout is the stall timeout (:mod:`.stalls`) where that is
    shorter: a request whose connection brings no byte for that long (a part or a range the store never
    answers) is abandoned and sent again by obstore's own retries."""
    if options.get("profile"):
        raise ValueError("s3_client='obstore' cannot read AWS profiles: give key and secret in storage_options "
                         "or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or use s3_client='s3fs'")
    client_kwargs = options.get("client_kwargs") or {}
    endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    config: dict[str, Any] = {}
    for ours, theirs in (("key", "access_key_id"), ("secret", "secret_access_key"), ("token", "session_token")):
        if options.get(ours):
            config[theirs] = options[ours]
    if options.get("anon"):
        config["skip_signature"] = True
    if endpoint:
        config["endpoint"] = endpoint
    if client_kwargs.get("region_name"):
        config["region"] = client_kwargs["region_name"]
    s3_config = (options.get("config_kwargs") or {}).get("s3") or {}
    if s3_config.get("payload_signing_enabled") is False:
        config["unsigned_payload"] = True  # botocore's switch for no SHA-256 of the bodies, obstore's name for it
    limit = CLIENT_TIMEOUT if deadline is None else min(CLIENT_TIMEOUT, deadline)
    client_options: dict[str, Any] = {
        "connect_timeout": datetime.timedelta(seconds=limit),
        "read_timeout": datetime.timedelta(seconds=min(limit, stall)),
        "timeout": datetime.timedelta(seconds=REQUEST_TIMEOUT if deadline is None else deadline),
    }
    if endpoint and str(endpoint).startswith("http://"):
        client_options["allow_http"] = True
    config["client_options"] = client_options
    config["retry_config"] = {"max_retries": CLIENT_RETRIES, "retry_timeout": client_options["timeout"]}
    return config


def unretried(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (:func:`store_config`) for a store that makes no retries of its own (see :data:`CLIENT_RETRIES`)."""
    return {**config, "retry_config": {**config["retry_config"], "max_retries": 0}}


def _refuse_metadata_probe(config: dict[str, Any]) -> None:
    """With no credentials given or in the environment, obstore asks the instance metadata address, also when
    ``AWS_EC2_METADATA_DISABLED`` says not to (botocore honours it): then no credentials is a denial, raised
    here, never traffic to that address."""
    disabled = os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() in ("true", "1")
    given = ("access_key_id" in config or config.get("skip_signature") or os.environ.get("AWS_ACCESS_KEY_ID")
             or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") or os.environ.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
             or os.environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"))
    if disabled and not given:
        raise PermissionError(errno.EACCES, "no S3 credentials: none in storage_options or the environment, and "
                                            "AWS_EC2_METADATA_DISABLED forbids asking the instance role")


def _part_size(size_hint: int | None) -> int:
    """The buffer of obstore's writer: one PUT below it, parts of its size above."""
    if size_hint is None:
        return UNKNOWN_SIZE_PART
    if size_hint <= SINGLE_PUT_MAX:
        return SINGLE_PUT_MAX + 1
    return max(UPLOAD_PART_SIZE, -(-size_hint // MAX_PARTS))


class ObstoreWriter(io.RawIOBase):
    """obstore's buffered writer: up to one part a single PUT at close, beyond that a multipart upload with
    :data:`PARTS_IN_FLIGHT` parts in flight, completed at close; :meth:`abort` aborts it (S3 keeps no parts).

    obstore aborts its upload once, and hides the upload's id: when that one abort fails too (the network that
    failed the upload is still down), the upload is found through s3fs (this key's uploads that were not there
    when ours began) and aborted with the s3fs writer's tries and pause. An upload of the same key that another
    writer began meanwhile is aborted with it; that writer's save fails and is retried."""

    def __init__(self, store: Any, key: str, part_size: int, on_partial: Callable[[Deadline], None], fs: Any,
                 path: str, deadline: Deadline) -> None:
        super().__init__()
        import obstore

        self._file = obstore.open_writer(store, key, buffer_size=part_size, max_concurrency=PARTS_IN_FLIGHT)
        self._part_size = part_size
        self._written = 0
        self._on_partial: Callable[[Deadline], None] | None = on_partial
        self._deadline = deadline
        self._fs, self._path = fs, path
        self._earlier: set[str] | None = None  # the ids of this key's unfinished uploads before ours began

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if self._on_partial is not None and self._written + n >= self._part_size:
            # The first part is about to leave: a killed process would leave an upload.
            self._on_partial(self._deadline)
            self._on_partial = None
            # Best effort: without this listing (a role that may not list uploads) only obstore's abort is tried.
            with contextlib.suppress(Exception):
                self._earlier = {upload_id for _, upload_id in self._uploads()}
        with self._named():
            self._file.write(b)
        self._written += n
        return n

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """A transient failure of the upload as :class:`~.stalls.TransferFailed` naming the part (its number, from
        the request's URL in obstore's message, and its bytes) or the single PUT, and the object."""
        try:
            yield
        except Exception as exc:
            if not is_transient(exc):
                raise
            failed = exc
        else:
            return
        number = _PART_NUMBER.search(str(failed))
        if number is not None:
            first = (int(number.group(1)) - 1) * self._part_size
            what = f"part {number.group(1)} (bytes {first}-{first + self._part_size - 1}) of s3://{self._path}"
        else:
            what = f"the upload of s3://{self._path}"
        raise TransferFailed(what, failed) from failed

    def close(self, before_commit: Callable[[Deadline], None] | None = None) -> None:
        """Send what is left and make the object visible; ``before_commit(deadline)`` runs just before that."""
        if self.closed:
            return
        if before_commit is not None:
            before_commit(self._deadline)
        with self._named():
            self._file.close()
        super().close()

    def abort(self) -> None:
        """Drop the upload: nothing becomes visible, no parts are kept. Never raises."""
        if self.closed:
            return
        # obstore's writer aborts its multipart upload when its block exits with an exception; its failure is
        # not reported: the caller's error is the one to report.
        with contextlib.suppress(Exception):
            self._file.__exit__(InterruptedError, InterruptedError("taskpoint aborted the write"), None)
        try:
            if self._earlier is not None:
                self._abort_leftover(self._earlier)
        finally:
            super().close()

    def _uploads(self) -> list[tuple[str, str]]:
        """This exact key's unfinished uploads, as (key, upload id)."""
        key = self._path.partition("/")[2]
        return [(k, upload_id) for k, upload_id, _ in _s3.unfinished_uploads(self._fs, self._path) if k == key]

    def _abort_leftover(self, earlier: set[str]) -> None:
        for attempt in range(_s3.ABORT_TRIES):
            try:
                for key, upload_id in self._uploads():
                    if upload_id not in earlier:
                        self._fs.abort_mpu(self._path.partition("/")[0], key, upload_id)
                return
            except Exception:
                if attempt + 1 < _s3.ABORT_TRIES:
                    time.sleep(_s3.ABORT_PAUSE)


class ObstoreRangeReader(ConcurrentRangeReader):
    """Ranged GETs through obstore, pinned to the ETag seen when the read began (``If-Match``): an object
    replaced under the read raises :class:`ObjectChanged`, and the read starts over from the new version."""

    def __init__(self, store: Any, path: str, size: int, **kwargs: Any) -> None:
        super().__init__(store, path, size, **kwargs)  # the bucket's obstore store in the place of the client
        self._store, self._key = store, path.partition("/")[2]
        self.uri = f"s3://{path}"

    def _fetch_range(self, start: int, end: int, deadline: Deadline) -> bytes:
        import obstore
        from obstore.exceptions import PreconditionError

        if end == start:
            return b""
        options: dict[str, Any] = {"range": (start, end)}
        if self.version is not None:
            options["if_match"] = self.version
        failed: Exception | None = None
        try:
            result = obstore.get(self._store, self._key, options=options)  # type: ignore[arg-type]
            if self.on_received is None:
                data: Any = result.bytes()
            else:  # told piece by piece: progress on slow links
                parts = []
                for piece in result.stream(min_chunk_size=RECEIVED_PIECE):
                    parts.append(piece)
                    self._received(len(piece))
                data = b"".join(parts)
        except PreconditionError:
            changed = True
        except Exception as exc:
            if not is_transient(exc):
                raise
            failed, changed = exc, False
        else:
            changed = False
        if changed:  # raised outside the handler: the client's 412 must not be read by the error map
            raise ObjectChanged(self._path, str(self.version))
        if failed is not None:  # named: obstore's message does not say which bytes
            raise TransferFailed(f"bytes {start}-{end - 1} of {self.uri}", failed) from failed
        return self._arrived(data, start, end, counted=True)  # type: ignore[no-any-return]  # obstore's Bytes: no copy


def _conflict(exc: BaseException) -> bool:
    """True when a conditional PUT's failure means another writer got there first (412, an existing object,
    409 while another conditional write is in progress, 404 of If-Match on a key that is gone)."""
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    if isinstance(exc, (PreconditionError, AlreadyExistsError)):
        return True
    code, status = code_and_status(exc)
    return status in (409, 412) or (status == 404 and code != "NoSuchBucket")


class ObstoreS3Backend(S3Backend):
    """S3 with obstore moving the bytes (writes, conditional record writes, reads pinned to the ETag) and s3fs
    doing what carries none (listings, checks, deletes, unfinished uploads)."""

    range_reader = ObstoreRangeReader
    #: obstore's own retries of the data path are invisible: the retry policy counts what reaches it.
    answers_watched = False

    def __init__(self, fs: Any, options: dict[str, Any], deadline: float | None, stall: float) -> None:
        super().__init__(fs, options)
        # The options s3fs was made with: those given, under fsspec's configuration (FSSPEC_S3, its files).
        self._config = store_config({**options, **getattr(fs, "storage_options", {})}, deadline, stall)
        self._stores: dict[tuple[str, bool], Any] = {}
        self._lock = threading.Lock()

    def credentials(self) -> str | None:
        if self.options.get("anon"):
            return "anonymous access (anon=True in storage_options)"
        if self.options.get("key") or self.options.get("secret"):
            return "the key and secret given in storage_options"
        return ("obstore's default chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_WEB_IDENTITY_TOKEN_FILE, "
                "then an instance or container role) for data, and botocore's default chain for listings")

    def _located(self, path: str, *, whole: bool = False) -> tuple[Any, str]:
        """The obstore store of ``path``'s bucket and the key; ``whole``: for a request that is a whole operation,
        the store that makes no retries of its own (:data:`CLIENT_RETRIES`). Two per bucket, each made once."""
        bucket, _, key = path.partition("/")
        with self._lock:
            store = self._stores.get((bucket, whole))
            if store is None:
                _refuse_metadata_probe(self._config)
                from obstore.store import S3Store

                config = unretried(self._config) if whole else self._config
                store = self._stores[bucket, whole] = S3Store(bucket, **config)
        return store, key

    def writer(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Any:
        """A small object of known size is one PUT, retried whole by the retry policy; others keep obstore's
        retries of their parts."""
        store, key = self._located(path, whole=size_hint is not None and size_hint <= SMALL_READ)
        return ObstoreWriter(store, key, _part_size(size_hint), hooks.on_partial, self.fs, path, self.deadline)

    def read_small(self, path: str) -> bytes:
        return self.read_versioned(path)[0]

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        import obstore

        store, key = self._located(path, whole=True)
        result = obstore.get(store, key)
        return bytes(result.bytes()), result.meta.get("e_tag")

    def write_versioned(self, path: str, data: bytes, expected: str | None) -> str | None:
        """One PUT with ``If-Match`` on the ETag read (``If-None-Match: *`` when there was no object)."""
        import obstore

        store, key = self._located(path, whole=True)
        mode: Any = "create" if expected is None else {"e_tag": expected}
        try:
            answer = obstore.put(store, key, data, mode=mode, use_multipart=False)
        except Exception as exc:
            if not _conflict(exc):
                raise
        else:
            return answer.get("e_tag")
        finally:
            self.fs.invalidate_cache(path)
        # Raised outside the handler: the client's 412 must not be its context, or the error map would read it.
        raise VersionConflict(f"{path} changed since it was read (expected version {expected})")

    def open_read(self, path: str, size_hint: int | None = None) -> IO[bytes]:
        """Expected small: one GET, whose answer also gives the size and ETag of a larger object than
        expected; otherwise one HEAD. Then ranged GETs pinned to that ETag."""
        import obstore

        store, key = self._located(path, whole=True)
        try:
            if size_hint is not None and size_hint <= SMALL_READ:
                result = obstore.get(store, key)
                meta = result.meta
                if meta["size"] <= SMALL_READ:
                    return WholeObject(bytes(result.bytes()))
            else:
                meta = obstore.head(store, key)
        except FileNotFoundError as exc:  # obstore's NotFoundError: no such key, or no such bucket
            if classify(exc) is not Failure.NO_CONTAINER and self.kind(path) is Kind.FOLDER:
                raise folder_error(path) from None
            raise
        return self.range_reader(self._located(path)[0], path, int(meta["size"]),  # type: ignore[return-value]
                                 version=meta.get("e_tag") or None, deadline=self.deadline,
                                 cap=self.pushback.cap, stall=self.stall)
