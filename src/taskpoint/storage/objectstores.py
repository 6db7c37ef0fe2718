"""The object stores' backends: GCS and Azure through their clients' uploads, S3 through taskpoint's own
multipart writer; large objects read as ranged GETs in parallel, pinned to the object's version where the
client can (S3's ETag, GCS's generation)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO, Any, ClassVar

from . import _s3
from .backends import (
    PART_SIZE,
    SMALL_READ,
    Backend,
    WholeObject,
    WriteHooks,
    bounded,
    folder_error,
)
from .streams import RANGE_SIZE, ConcurrentRangeReader, ObjectChanged


class ObjectStoreBackend(Backend):
    """GCS, Azure and other object stores: the client's upload (discarded on failure), ranged reads."""

    has_folders = False
    #: The reader of large objects (ranged GETs in parallel); S3's pins every range to the object's ETag.
    range_reader: ClassVar[type[ConcurrentRangeReader]] = ConcurrentRangeReader

    def open_read(self, path: str, size_hint: int | None = None) -> IO[bytes]:
        self.fs.invalidate_cache(path)
        info = self.fs.info(path, **bounded(self.fs))
        if info.get("type") != "file":
            # A prefix with objects under it: never read it as an empty object.
            raise folder_error(path)
        size = int(info["size"])
        if size > 2 * RANGE_SIZE:
            return self.range_reader(self.fs, path, size, version=self.version_of(info))  # type: ignore[return-value]
        return self.fs.open(path, "rb", block_size=PART_SIZE, cache_type="readahead")  # type: ignore[no-any-return]

    def version_of(self, info: dict[str, Any]) -> str | None:
        """The version of an object (S3's ETag, GCS's generation) that reads can be pinned to; None where the
        store's client cannot pin ranged reads (Azure through adlfs: a change shows as a size or checksum
        mismatch there)."""
        return None

    @contextlib.contextmanager
    def open_write(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Iterator[IO[bytes]]:
        f = self.fs.open(path, "wb", block_size=PART_SIZE)
        try:
            yield f
            hooks.before_commit()
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
            self.fs.info(bucket, **bounded(self.fs))
        except FileNotFoundError:
            return True
        return False


class GenerationRangeReader(ConcurrentRangeReader):
    """GCS: ranged GETs of the object's generation seen when the read began (``generation=``). Once the object
    is replaced that generation is gone (404, unless the bucket keeps versions: then the read stays on it),
    and :class:`ObjectChanged` starts the read over from the new one."""

    def _fetch(self, start: int, end: int) -> bytes:
        if self.version is None:
            return super()._fetch(start, end)
        try:
            data: bytes = self._fs.cat_file(self._path, start=start, end=end, generation=self.version)
        except FileNotFoundError as exc:
            raise ObjectChanged(self._path, self.version) from exc
        if len(data) != end - start:
            raise OSError(f"short ranged read of {self._path}: {len(data)} of {end - start} bytes")
        self._received(len(data))
        return data


class GCSBackend(ObjectStoreBackend):
    """GCS: large objects are read as ranged GETs pinned to the generation seen when the read began."""

    range_reader = GenerationRangeReader

    def version_of(self, info: dict[str, Any]) -> str | None:
        generation = info.get("generation")
        return str(generation) if generation not in (None, "") else None


class S3Backend(ObjectStoreBackend):
    """S3: taskpoint's multipart writer (parts in flight, one PUT up to 64 MiB), upload listing and abort; large
    objects are read as ranged GETs pinned to the ETag seen when the read began (``If-Match``)."""

    range_reader = _s3.S3RangeReader

    def version_of(self, info: dict[str, Any]) -> str | None:
        etag = info.get("ETag")
        return etag if isinstance(etag, str) and etag else None

    @contextlib.contextmanager
    def open_write(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Iterator[IO[bytes]]:
        single = size_hint is not None and size_hint <= _s3.SINGLE_PUT_MAX
        writer = _s3.S3MultipartWriter(self.fs, path, part_size=_s3.SINGLE_PUT_MAX + 1 if single
                                       else _s3.UPLOAD_PART_SIZE, on_upload_started=hooks.on_partial)
        try:
            yield writer  # type: ignore[misc]
            writer.close(before_commit=hooks.before_commit)
        except BaseException:
            writer.abort()
            raise
        finally:
            self.fs.invalidate_cache(path)

    def read_small(self, path: str) -> bytes:
        return _s3.get_object(self.fs, path, limit=None, **bounded(self.fs))[0]

    def open_read(self, path: str, size_hint: int | None = None) -> IO[bytes]:
        if size_hint is not None and size_hint <= SMALL_READ:
            # Expected small: one GET instead of a HEAD and a GET. If the object turns out larger than that, it
            # is not the one expected: read it the usual way.
            data, complete = _s3.get_object(self.fs, path, limit=SMALL_READ, **bounded(self.fs))
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
