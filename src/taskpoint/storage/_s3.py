"""S3 specifics: taskpoint's own multipart writer, and the listing and aborting of unfinished uploads."""

from __future__ import annotations

import collections
import contextlib
import io
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..executors import IO
from ..signals import uninterrupted
from .deadline import NO_DEADLINE, Deadline, bounded
from .errormap import chain, code_and_status, swept_while_written
from .stalls import STALL_TIMEOUT, MeteredBody, until_stalled, watched
from .streams import ConcurrentRangeReader, ObjectChanged, VersionConflict
from .throttle import s3fs_events

#: Size of the parts of taskpoint's own S3 multipart uploads (S3 allows 10,000 parts: 80 GB at this size;
#: the part size doubles every 1,000 parts so that any checkpoint fits).
UPLOAD_PART_SIZE = 8 << 20
#: Objects of known size up to this go up as one PUT (fewer requests than a multipart upload).
SINGLE_PUT_MAX = 64 << 20
#: Parts of a multipart upload in flight at once (memory: this x the part size).
PARTS_IN_FLIGHT = 4
#: Piece in which a ranged GET's body is read when someone watches the load's progress.
RECEIVED_PIECE = 256 << 10
#: Tries of the abort of a failed upload (each with the client's own retries), and the pause between them: a
#: failure that cut the network for a moment must not leave a billed upload behind. Only two: against a
#: network that stays down each try waits out the client's timeouts. A later save's sweep, or ``taskpoint gc``,
#: removes what could not be aborted.
ABORT_TRIES = 2
ABORT_PAUSE = 0.5


class S3MultipartWriter(io.RawIOBase):
    """Uploads to S3 with several parts in flight, so compression and upload overlap; atomic by protocol.

    Up to one part of data is a single PUT. Beyond that a multipart upload is started, each full part is
    sent by a pool (at most :data:`PARTS_IN_FLIGHT`, so memory stays bounded), and ``close()`` completes the
    upload: the object appears whole, at that moment. ``abort()`` aborts the upload: S3 keeps no parts.
    Each request, parts on the pool's threads too, is given the time left before ``deadline`` (the retried
    write's); ``on_upload_started`` is given the deadline. ``cap``: the store's cap on requests in flight, which
    lowers the parts sent at once while it throttles. A part (or the single PUT) that makes no progress for
    ``stall`` seconds is sent again (:func:`~.stalls.watched`), and named when the deadline passes.
    """

    def __init__(self, fs: Any, path: str, *, part_size: int = UPLOAD_PART_SIZE,
                 in_flight: int = PARTS_IN_FLIGHT, on_upload_started: Callable[[Deadline], None] | None = None,
                 deadline: Deadline = NO_DEADLINE, cap: Callable[[int], int] | None = None,
                 stall: float = STALL_TIMEOUT):
        super().__init__()
        self._on_upload_started = on_upload_started
        self._deadline = deadline
        self._stall = stall
        self._sent = 0  # bytes handed to parts so far: where the next part starts
        self._fs = fs
        self._bucket, _, self._key = path.partition("/")
        self._part_size = part_size
        self._in_flight = in_flight
        self._pool = IO.lane(in_flight, cap)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Any] = []
        self._unsettled: collections.deque[Any] = collections.deque()

    def writable(self) -> bool:
        return True

    def _current_part_size(self) -> int:
        return self._part_size << (len(self._parts) // 1000)

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._buf += view
        while len(self._buf) >= (size := self._current_part_size()):
            part = bytes(memoryview(self._buf)[:size])
            del self._buf[:size]
            self._send(part)
        return view.nbytes

    def _send(self, data: bytes) -> None:
        if self._upload_id is None:
            if self._on_upload_started is not None:
                self._on_upload_started(self._deadline)
            # Uninterrupted: an upload started on the server is aborted only if its id is kept (the request runs
            # on fsspec's IO thread and completes even when a signal ends the wait for it).
            with uninterrupted():
                started = self._fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key,
                                           **bounded(self._fs, self._deadline))
                self._upload_id = started["UploadId"]
        number = len(self._parts) + 1
        # Bounded: settle the oldest parts (raising a failed one's error) until another may leave memory's
        # reach. A deque of the unsettled ones keeps this O(1) per part, also for 10,000-part uploads.
        while self._unsettled and (self._unsettled[0].done() or len(self._unsettled) >= self._in_flight):
            self._unsettled.popleft().result()
        future = self._pool.submit(self._upload_part, number, data, self._sent)
        self._sent += len(data)
        self._parts.append(future)
        self._unsettled.append(future)

    def _upload_part(self, number: int, data: bytes, start: int) -> dict[str, Any]:
        what = f"part {number} (bytes {start}-{start + len(data) - 1}) of s3://{self._bucket}/{self._key}"
        with self._not_aborted():
            answer = self._metered("upload_part", data, what, UploadId=self._upload_id, PartNumber=number)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _metered(self, method: str, data: bytes, what: str, **kwargs: Any) -> dict[str, Any]:
        """One request of ``method`` sending ``data`` to this writer's key, abandoned and sent again whenever its
        body made no progress for the stall timeout (:func:`~.stalls.until_stalled`), until the deadline."""
        from fsspec.asyn import sync

        def send(attempt: Deadline) -> dict[str, Any]:
            body = MeteredBody(data)
            return sync(self._fs.loop, until_stalled,  # type: ignore[no-any-return]
                        lambda: self._fs._call_s3(method, Bucket=self._bucket, Key=self._key, Body=body, **kwargs),
                        body, self._stall, **bounded(self._fs, attempt))

        return watched(send, what=what, size=len(data), deadline=self._deadline, stall=self._stall, metered=True)

    @contextlib.contextmanager
    def _not_aborted(self) -> Iterator[None]:
        """Raise SaveStalledError when a request of this writer's upload fails because the upload no longer
        exists: only an abort by someone else (a sweep that took it for a dead writer's) ends an upload this
        writer has not finished. S3 answers so (``NoSuchUpload``); where a server answers otherwise (moto: 500),
        one listing of the upload's parts tells."""
        try:
            yield
        except Exception as exc:
            if _code(exc) != "NoSuchUpload" and not self._upload_gone():
                raise
            raise swept_while_written(f"{self._bucket}/{self._key}", f"multipart upload {self._upload_id}") from exc

    def _upload_gone(self) -> bool:
        """Whether S3 says this writer's upload does not exist (False when it cannot tell)."""
        try:
            self._fs.call_s3("list_parts", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MaxParts=1,
                             **bounded(self._fs, self._deadline))
        except Exception as exc:
            return _code(exc) == "NoSuchUpload"
        return False

    def close(self, before_commit: Callable[[Deadline], None] | None = None) -> None:
        """Send what is left and make the object visible; ``before_commit(deadline)`` runs just before that
        moment. If that fails, whether a part still in flight failed or the completion itself, the upload is
        aborted before the error is raised: never left open and billed."""
        if self.closed:
            return
        try:
            if self._upload_id is None:
                if before_commit is not None:
                    before_commit(self._deadline)
                body = bytes(self._buf)
                self._metered("put_object", body, f"the PUT of s3://{self._bucket}/{self._key} ({len(body)} bytes)")
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                parts = [f.result() for f in self._parts]
                if before_commit is not None:
                    before_commit(self._deadline)
                with self._not_aborted():
                    self._fs.call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                                     UploadId=self._upload_id, MultipartUpload={"Parts": parts},
                                     **bounded(self._fs, self._deadline))
        except BaseException:
            self.abort()
            raise
        finally:
            self._finish(cancel=False)

    def abort(self) -> None:
        """Drop the upload; nothing becomes visible and no parts are kept. Never raises: the caller's error is
        the one to report."""
        if self.closed:
            return
        try:
            self._finish(cancel=True)
            if self._upload_id is not None:
                self._abort_upload()
        finally:
            super().close()

    def _finish(self, *, cancel: bool) -> None:
        if cancel:
            for f in self._parts:
                f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        self._buf = bytearray()
        if not cancel:
            super().close()

    def _abort_upload(self) -> None:
        for attempt in range(ABORT_TRIES):
            try:
                self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                 UploadId=self._upload_id)
                return
            except Exception as exc:
                if _code(exc) == "NoSuchUpload":
                    return  # already gone
                if attempt + 1 < ABORT_TRIES:
                    time.sleep(ABORT_PAUSE)


def _code(exc: BaseException) -> str | None:
    """The S3 error code (or HTTP status) anywhere in an exception's chain (s3fs wraps botocore's ClientError)."""
    for each in chain(exc):
        code, status = code_and_status(each)
        if code or status:
            return code or str(status)
    return None


class S3RangeReader(ConcurrentRangeReader):
    """Ranged GETs pinned to the ETag the object had when the read began (``If-Match``): if the object is
    replaced meanwhile, the next range fails with 412 and :class:`ObjectChanged` is raised (a transient error:
    the retry policy starts the read over, from the new version) instead of two versions being mixed."""

    def _fetch_range(self, start: int, end: int, deadline: Deadline) -> bytes:
        if self.version is None:
            return super()._fetch_range(start, end, deadline)
        from fsspec.asyn import sync

        bucket, _, key = self._path.partition("/")
        try:
            data: bytes = sync(self._fs.loop, self._get, bucket, key, start, end, **bounded(self._fs, deadline))
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "412"):
                raise ObjectChanged(self._path, self.version) from exc
            raise
        return self._arrived(data, start, end, counted=True)  # counted piece by piece by _get

    async def _get(self, bucket: str, key: str, start: int, end: int) -> bytes:
        answer = await self._fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                         IfMatch=self.version)
        body = answer["Body"]
        try:
            if self.on_received is None:
                return await body.read()  # type: ignore[no-any-return]
            parts = []
            while chunk := await body.read(RECEIVED_PIECE):  # told piece by piece: progress on slow links
                parts.append(chunk)
                self._received(len(chunk))
            return b"".join(parts)
        finally:
            body.close()


def unfinished_uploads(fs: Any, path: str) -> list[tuple[str, str, float]]:
    """The multipart uploads begun under ``path`` (bucket/prefix) and never completed or aborted, as
    (key, upload id, initiation time). Pages through the listing."""
    bucket, _, prefix = path.partition("/")
    found: list[tuple[str, str, float]] = []
    markers: dict[str, str] = {}
    while True:
        listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        found += [(u["Key"], u["UploadId"], u["Initiated"].timestamp()) for u in listing.get("Uploads", [])]
        if not listing.get("IsTruncated"):
            return found
        markers = {"KeyMarker": listing["NextKeyMarker"], "UploadIdMarker": listing["NextUploadIdMarker"]}


def get_object(fs: Any, path: str, *, limit: int | None, timeout: float | None = None) -> tuple[bytes, bool]:
    """One GET of ``path``: its bytes (at most ``limit`` + 1 of them) and whether that was the whole object.

    ``fs.cat_file`` asks for the size first (a HEAD, and a listing when the key is missing): two more
    requests for every small object. ``timeout`` cancels the call (fsspec's FSTimeoutError).
    """
    data, complete, _ = get_tagged(fs, path, limit=limit, timeout=timeout)
    return data, complete


def get_tagged(fs: Any, path: str, *, limit: int | None,
               timeout: float | None = None) -> tuple[bytes, bool, str | None]:
    """:func:`get_object`, with the ETag of the version read."""
    from fsspec.asyn import sync

    bucket, _, key = path.partition("/")

    async def get() -> tuple[bytes, bool, str | None]:
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        body, etag = answer["Body"], answer.get("ETag")
        try:
            if limit is None:
                return await body.read(), True, etag
            parts, got = [], 0
            while got <= limit:  # a read may return less than asked at any time
                chunk = await body.read(limit + 1 - got)
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
            return b"".join(parts), got <= limit, etag
        finally:
            body.close()

    return sync(fs.loop, get, timeout=timeout)  # type: ignore[no-any-return]


#: The answers of a conditional PUT that mean "another writer got there first": 412, and 409 while another
#: conditional write of the key is in progress; 404 where a server answers If-Match on a missing key so.
_CONFLICTS = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404")


def put_if(fs: Any, path: str, data: bytes, expected: str | None, *, timeout: float | None = None) -> str | None:
    """One PUT of ``data`` that lands only if the object is still at ETag ``expected`` (None: only if there is
    no object). Returns the new ETag; raises :class:`VersionConflict` when another writer changed it."""
    from fsspec.asyn import sync

    bucket, _, key = path.partition("/")
    condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}

    async def put() -> str | None:
        answer = await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        etag = answer.get("ETag")
        return etag if isinstance(etag, str) and etag else None

    try:
        return sync(fs.loop, put, timeout=timeout)  # type: ignore[no-any-return]
    except Exception as exc:
        if _code(exc) not in _CONFLICTS:
            raise
    finally:
        fs.invalidate_cache(path)
    # Raised outside the handler: the client's 412 must not be its context, or the error map would read it.
    raise VersionConflict(f"{path} changed since it was read (expected version {expected})")


def holds(fs: Any, path: str, *, timeout: float | None = None) -> tuple[bool, bool]:
    """Whether ``path`` (``bucket/key``) is an object, and whether any object lies under ``path/``: its HEAD
    and a listing of one key sent together, one round trip where s3fs's ``info`` makes them one after the other
    for a name that holds no object (what a save's check of its destination asks the first time). Errors other
    than the HEAD's "not found" are raised (a missing bucket's among them)."""
    import asyncio

    from fsspec.asyn import sync

    bucket, _, key = path.partition("/")

    async def both() -> list[Any]:
        return list(await asyncio.gather(fs._call_s3("head_object", Bucket=bucket, Key=key),
                                         fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{key}/", MaxKeys=1),
                                         return_exceptions=True))

    head, listing = sync(fs.loop, both, timeout=timeout)
    if isinstance(head, BaseException) and not isinstance(head, FileNotFoundError):
        raise head
    if isinstance(listing, BaseException):
        raise listing
    return not isinstance(head, BaseException), bool(listing.get("KeyCount") or listing.get("Contents"))


#: Bodies up to this size are sent without ``Expect: 100-continue`` (:func:`small_bodies_without_continue`).
CONTINUE_ABOVE_BYTES = 1 << 20


def small_bodies_without_continue(fs: Any) -> None:
    """Send a request of ``fs``'s botocore client whose body is small (a record, a manifest, a small object)
    without the ``Expect: 100-continue`` that botocore adds to every body it can read. aiohttp waits for the
    ``100 Continue`` under no client timeout, so such a PUT to an endpoint that accepts connections and never
    answers waited out the whole retry deadline (120 s by default) where a GET ends at the client's read timeout.
    Sparing a small body is all the header is for; large bodies keep it. Registered once per filesystem."""
    from botocore.utils import determine_content_length  # type: ignore[import-untyped]

    def without_continue(params: Any = None, **_: Any) -> None:
        size = determine_content_length(params["body"]) if params and params.get("body") is not None else None
        if size is not None and size <= CONTINUE_ABOVE_BYTES:
            params["headers"].pop("Expect", None)

    for events in s3fs_events(fs):  # after botocore adds it
        events.register_last("before-call.s3", without_continue, unique_id="taskpoint-small-without-continue")

