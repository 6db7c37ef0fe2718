"""The object stores' backends: GCS and Azure through their clients' uploads, S3 through taskpoint's own
multipart writer; large objects read as ranged GETs in parallel, pinned to the object's version where the
client can (S3's ETag, GCS's generation)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
from collections.abc import Iterator
from typing import IO, Any, ClassVar

from fsspec.asyn import sync

from . import _s3
from .backends import (
    PART_SIZE,
    SMALL_READ,
    Backend,
    Kind,
    WholeObject,
    WriteHooks,
    folder_error,
)
from .deadline import Deadline, bounded
from .errormap import chain, code_and_status
from .streams import RANGE_SIZE, ConcurrentRangeReader, ObjectChanged, VersionConflict
from .throttle import watch_azure, watch_s3fs


class ObjectStoreBackend(Backend):
    """GCS, Azure and other object stores: the client's upload (discarded on failure), ranged reads."""

    has_folders = False
    #: The reader of large objects (ranged GETs in parallel); S3's pins every range to the object's ETag.
    range_reader: ClassVar[type[ConcurrentRangeReader]] = ConcurrentRangeReader

    def open_read(self, path: str, size_hint: int | None = None) -> IO[bytes]:
        if size_hint is not None and 0 < size_hint <= SMALL_READ:
            # Expected small (the record says so): one ranged GET, which returns one version whole, instead of a
            # listing and a GET that another writer's replacement can fall between. An object larger than that
            # is not the one expected: read it the usual way.
            try:
                data: bytes = self.fs.cat_file(path, start=0, end=SMALL_READ + 1, **bounded(self.fs, self.deadline))
            except FileNotFoundError:
                pass  # absent, or a prefix: told apart below
            except Exception as exc:
                if not _empty_range(exc):
                    raise  # an empty object answers a range with 416: read below, whole
            else:
                if len(data) <= SMALL_READ:
                    return WholeObject(data)
        self.fs.invalidate_cache(path)
        # adlfs forgets only the path itself, and answers info() from its parent's cached listing: the size and
        # version of an object replaced since that listing would be stale.
        self.fs.invalidate_cache(self.fs._parent(path))
        info = self.fs.info(path, **bounded(self.fs, self.deadline))
        if info.get("type") != "file":
            # A prefix with objects under it: never read it as an empty object.
            raise folder_error(path)
        size, version = int(info["size"]), self.version_of(info)
        if size > 2 * RANGE_SIZE or version is not None:
            # Pinned to the version just seen: an object replaced under the read raises ObjectChanged and the
            # read starts over, never mixing two versions (small objects are one range).
            return self.range_reader(self.fs, path, size, version=version,  # type: ignore[return-value]
                                     deadline=self.deadline, cap=self.pushback.cap, stall=self.stall)
        return self.fs.open(path, "rb", block_size=PART_SIZE, cache_type="readahead")  # type: ignore[no-any-return]

    def _prefixed(self, prefix: str) -> dict[str, str]:
        return {"prefix": prefix} if prefix else {}  # s3fs, gcsfs and adlfs list only keys under path/prefix

    def version_of(self, info: dict[str, Any]) -> str | None:
        """The version of an object (S3's ETag, GCS's generation, Azure's ETag) that reads can be pinned to;
        None where the store's client cannot pin ranged reads (a change shows as a size or checksum mismatch)."""
        return None

    @contextlib.contextmanager
    def open_write(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Iterator[IO[bytes]]:
        """An object expected to fit in one part (a record, a manifest, a lease, a small payload) goes up as one
        request, given the time left before the deadline (:func:`~.deadline.bounded`); a larger one through the
        client's file, which streams it in parts and which taskpoint cannot interrupt (bounded by the client's
        own timeouts). The client's file sends even a small object as two requests that nothing bounded but the
        client: gcsfs's resumable upload (its start, then its one chunk), adlfs's block and block list. To an
        endpoint that accepts connections and never answers, such a write waited 324 s on Azure (four tries of
        the SDK's 60 s read timeout) under a retry deadline of 60 s, and over 18 minutes on GCS (measured on
        127.0.0.1)."""
        if size_hint is not None and size_hint <= PART_SIZE:
            whole = io.BytesIO()
            yield whole
            hooks.before_commit(self.deadline)
            try:
                self.fs.pipe_file(path, whole.getvalue(), **bounded(self.fs, self.deadline))
            finally:
                self.fs.invalidate_cache(path)
            return
        f = self.fs.open(path, "wb", block_size=PART_SIZE)
        try:
            yield f
            hooks.before_commit(self.deadline)
            f.close()
        except BaseException:
            # fsspec files commit in close() and __del__: discard the upload and mark the file closed so
            # that neither ever runs.
            try:
                f.discard()
            except Exception:  # the upload's own error is the one to report
                pass
            finally:
                f.closed = True
            raise
        finally:
            self.fs.invalidate_cache(path)

    def container_missing(self, path: str) -> bool:
        # Not fs.exists(): it answers False for any error, which would turn an outage into "no bucket".
        bucket = path.split("/", 1)[0]
        self.fs.invalidate_cache(bucket)
        try:
            self.fs.info(bucket, **bounded(self.fs, self.deadline))
        except FileNotFoundError:
            return True
        return False


def _empty_range(exc: BaseException) -> bool:
    """True for the answer to a range of an empty object (416, ``InvalidRange``)."""
    for each in chain(exc):
        code, status = code_and_status(each)
        if status == 416 or code == "InvalidRange" or getattr(each, "code", None) == 416:
            return True
    return False


class GenerationRangeReader(ConcurrentRangeReader):
    """GCS: ranged GETs of the object's generation seen when the read began (``generation=``). Once the object
    is replaced that generation is gone (404, unless the bucket keeps versions: then the read stays on it),
    and :class:`ObjectChanged` starts the read over from the new one."""

    def _fetch_range(self, start: int, end: int, deadline: Deadline) -> bytes:
        if self.version is None:
            return super()._fetch_range(start, end, deadline)
        try:
            data: bytes = self._fs.cat_file(self._path, start=start, end=end, generation=self.version,
                                            **bounded(self._fs, deadline))
        except FileNotFoundError as exc:
            raise ObjectChanged(self._path, self.version) from exc
        return self._arrived(data, start, end)


class GCSBackend(ObjectStoreBackend):
    """GCS: large objects are read as ranged GETs pinned to the generation seen when the read began."""

    range_reader = GenerationRangeReader
    answers_watched = True

    def endpoint(self) -> str | None:
        """The URL gcsfs sends requests to (an emulator's, or Google's)."""
        url = getattr(self.fs, "_location", None)
        return url if isinstance(url, str) else None

    def version_of(self, info: dict[str, Any]) -> str | None:
        generation = info.get("generation")
        return str(generation) if generation not in (None, "") else None

    conditional = True

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """One GET of the object's media, and the generation it came from (``x-goog-generation``)."""
        bucket, key, _ = self.fs.split_path(path)
        headers, data = sync(self.fs.loop, self.fs._call, "GET", "b/{}/o/{}", bucket, key, alt="media",
                             **bounded(self.fs, self.deadline))
        generation = headers.get("x-goog-generation")
        return bytes(data), str(generation) if generation else None

    def write_versioned(self, path: str, data: bytes, expected: str | None) -> str | None:
        """One multipart upload with ``ifGenerationMatch`` (0: only if there is no object)."""
        bucket, key, _ = self.fs.split_path(path)
        boundary = "==taskpoint=="
        body = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': key})}\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
                ).encode() + data + f"\r\n--{boundary}--".encode()
        try:
            answer = sync(self.fs.loop, self.fs._call, "POST", f"{self.fs._location}/upload/storage/v1/b/{bucket}/o",
                          uploadType="multipart", ifGenerationMatch=expected or "0", data=body, json_out=True,
                          headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
                          **bounded(self.fs, self.deadline))
        except FileExistsError:  # gcsfs's name for 412: the generation is not the one expected
            pass
        else:
            generation = answer.get("generation")
            return str(generation) if generation else None
        finally:
            self.fs.invalidate_cache(path)
        # Raised outside the handler: the client's 412 must not be its context, or the error map would read it.
        raise VersionConflict(f"{path} changed since it was read (expected generation {expected or 'none'})")


class ETagRangeReader(ConcurrentRangeReader):
    """Azure: ranged GETs pinned to the blob's ETag (``If-Match``): a blob replaced or deleted under the read
    raises :class:`ObjectChanged`, and the read starts over."""

    def _fetch_range(self, start: int, end: int, deadline: Deadline) -> bytes:
        if self.version is None:
            return super()._fetch_range(start, end, deadline)
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        container, blob, _ = self._fs.split_path(self._path)

        async def get() -> bytes:
            async with self._fs.service_client.get_blob_client(container=container, blob=blob) as client:
                stream = await client.download_blob(offset=start, length=end - start, etag=self.version,
                                                    match_condition=MatchConditions.IfNotModified)
                return await stream.readall()  # type: ignore[no-any-return]

        if end == start:
            return b""
        try:
            data: bytes = sync(self._fs.loop, get, **bounded(self._fs, deadline))
        except (ResourceModifiedError, ResourceNotFoundError):
            changed = True
        else:
            changed = False
        if changed:  # raised outside the handler: the client's error must not be read by the error map
            raise ObjectChanged(self._path, self.version)
        return self._arrived(data, start, end)


class AzureBackend(ObjectStoreBackend):
    """Azure Blob Storage: the client's uploads; ranged reads pinned to the blob's ETag; records written
    conditionally on it."""

    range_reader = ETagRangeReader
    conditional = True
    answers_watched = True

    def __init__(self, fs: Any, options: dict[str, Any]) -> None:
        super().__init__(fs, options)
        watch_azure(fs, self.pushback)

    def endpoint(self) -> str | None:
        """The account's URL, from the connection string or the account's name (adlfs's service client): it names
        the store, and a failure that says only that no answer came is told refused or silent by connecting to it."""
        url = getattr(getattr(self.fs, "service_client", None), "url", None)
        return url if isinstance(url, str) else None

    def version_of(self, info: dict[str, Any]) -> str | None:
        etag = info.get("etag")
        return str(etag) if etag else None

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        from azure.core.exceptions import ResourceNotFoundError

        container, blob, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes, str | None]:
            async with self.fs.service_client.get_blob_client(container=container, blob=blob) as client:
                stream = await client.download_blob()
                return await stream.readall(), stream.properties.etag

        try:
            data, etag = sync(self.fs.loop, get, **bounded(self.fs, self.deadline))
        except ResourceNotFoundError:
            pass  # raised below, outside the handler, as the FileNotFoundError of a missing object
        else:
            return data, etag
        raise FileNotFoundError(errno.ENOENT, "no such blob", path)

    def write_versioned(self, path: str, data: bytes, expected: str | None) -> str | None:
        """One upload with ``If-Match`` on the ETag read (or ``If-None-Match: *`` when there was no blob)."""
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

        container, blob, _ = self.fs.split_path(path)
        condition: dict[str, Any] = ({"overwrite": False} if expected is None else
                                     {"overwrite": True, "etag": expected,
                                      "match_condition": MatchConditions.IfNotModified})

        async def put() -> str | None:
            async with self.fs.service_client.get_blob_client(container=container, blob=blob) as client:
                answer = await client.upload_blob(data, **condition)
                etag = answer.get("etag")
                return str(etag) if etag else None

        try:
            return sync(self.fs.loop, put, **bounded(self.fs, self.deadline))  # type: ignore[no-any-return]
        except (ResourceExistsError, ResourceModifiedError):
            pass
        except ResourceNotFoundError as exc:
            if "BlobNotFound" not in str(getattr(exc, "error_code", "")) and "BlobNotFound" not in str(exc):
                raise FileNotFoundError(errno.ENOENT, "no such container", path) from exc
        finally:
            self.fs.invalidate_cache(path)
        raise VersionConflict(f"{path} changed since it was read (expected ETag {expected or 'none'})")


class S3Backend(ObjectStoreBackend):
    """S3: taskpoint's multipart writer (parts in flight, one PUT up to 64 MiB), upload listing and abort; large
    objects are read as ranged GETs pinned to the ETag seen when the read began (``If-Match``)."""

    range_reader: ClassVar[type[ConcurrentRangeReader]] = _s3.S3RangeReader
    answers_watched = True

    def __init__(self, fs: Any, options: dict[str, Any]) -> None:
        super().__init__(fs, options)
        watch_s3fs(fs, self.pushback)
        _s3.small_bodies_without_continue(fs)

    def endpoint(self) -> str | None:
        """``endpoint_url`` (an option, ``client_kwargs`` or fsspec's configuration); None: AWS's own."""
        url = getattr(self.fs, "endpoint_url", None) or (getattr(self.fs, "client_kwargs", None) or {}).get(
            "endpoint_url")
        return url if isinstance(url, str) else None

    def version_of(self, info: dict[str, Any]) -> str | None:
        etag = info.get("ETag")
        return etag if isinstance(etag, str) and etag else None

    def kind(self, path: str) -> Kind:
        """One round trip (:func:`_s3.holds`) for a key; a bucket as every store answers it."""
        if not path.partition("/")[2]:
            return super().kind(path)
        self.fs.invalidate_cache(path)
        is_object, has_children = _s3.holds(self.fs, path, **bounded(self.fs, self.deadline))
        return Kind.OBJECT if is_object else Kind.FOLDER if has_children else Kind.NOTHING

    def writer(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Any:
        """The multipart writer of one object: ``close(before_commit=...)`` makes it visible, ``abort()`` drops it."""
        single = size_hint is not None and size_hint <= _s3.SINGLE_PUT_MAX
        return _s3.S3MultipartWriter(self.fs, path, part_size=_s3.SINGLE_PUT_MAX + 1 if single
                                     else _s3.UPLOAD_PART_SIZE, on_upload_started=hooks.on_partial,
                                     deadline=self.deadline, cap=self.pushback.cap, stall=self.stall)

    @contextlib.contextmanager
    def open_write(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Iterator[IO[bytes]]:
        writer = self.writer(path, size_hint, hooks)
        try:
            yield writer
            writer.close(before_commit=hooks.before_commit)
        except BaseException:
            writer.abort()
            raise
        finally:
            self.fs.invalidate_cache(path)

    def read_small(self, path: str) -> bytes:
        return _s3.get_object(self.fs, path, limit=None, **bounded(self.fs, self.deadline))[0]

    conditional = True

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        data, _, etag = _s3.get_tagged(self.fs, path, limit=None, **bounded(self.fs, self.deadline))
        return data, etag

    def write_versioned(self, path: str, data: bytes, expected: str | None) -> str | None:
        return _s3.put_if(self.fs, path, data, expected, **bounded(self.fs, self.deadline))

    def open_read(self, path: str, size_hint: int | None = None) -> IO[bytes]:
        if size_hint is not None and size_hint <= SMALL_READ:
            # Expected small: one GET instead of a HEAD and a GET. If the object turns out larger than that, it
            # is not the one expected: read it the usual way.
            data, complete = _s3.get_object(self.fs, path, limit=SMALL_READ, **bounded(self.fs, self.deadline))
            if complete:
                return WholeObject(data)
        return super().open_read(path, size_hint)

    def sweep_leftovers(self, path: str, started_before: float) -> None:
        """Multipart uploads of this exact key that began before ``started_before`` (the caller's own save has
        committed by then). GCS resumable uploads and Azure uncommitted blocks are invisible and expire on
        their own after a week."""
        key = path.partition("/")[2]
        for upload_key, upload_id, initiated in self.unfinished_uploads(path):
            if upload_key == key and initiated < started_before:
                self.abort_upload(path, upload_key, upload_id)

    def unfinished_uploads(self, path: str) -> list[tuple[str, str, float]]:
        return _s3.unfinished_uploads(self.fs, path)

    def abort_upload(self, path: str, key: str, upload_id: str) -> None:
        self.fs.abort_mpu(path.partition("/")[0], key, upload_id)
