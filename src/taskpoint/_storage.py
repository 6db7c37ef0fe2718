"""fsspec access: atomic writes, streaming reads, and bounded retries with backoff.

Every write becomes visible whole or not at all:
- local disk: a temp file in the same folder, fsync, rename, fsync of the folder;
- object stores (S3, GCS, Azure): one PUT, or a multipart upload that is aborted when anything fails;
- any other filesystem: a temp object beside the destination, then a move.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ._prefetch import OrderedFutureReader
from .errors import CheckpointError, StorageError

T = TypeVar("T")

#: Size of the parts of a multipart upload, and of read-ahead blocks on remote stores.
PART_SIZE = 16 << 20
#: Buffer of local reads. Readers ask for whole gzip members or pieces of a MiB, which bypass it; larger
#: buffers only cost a first read that is mostly thrown away (a 16 MiB one took 30% of a 64 MiB bytes load).
LOCAL_READ_BUFFER = 1 << 20
#: Age after which a temp object or unfinished upload of a killed save is swept by a later save. A writer
#: that is still alive keeps touching its temp file, so this never disturbs a concurrent save.
LEFTOVER_GRACE_SECONDS = 15 * 60
#: Protocols whose writers upload in parts and can abort them (``discard``) so nothing partial appears.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})
#: Exceptions that say "this will not get better by trying again".
_PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
    ValueError, TypeError, NotImplementedError, ImportError, CheckpointError,
)
_TRANSIENT_MODULES = ("aiohttp", "botocore", "azure", "google", "requests", "urllib3", "http", "ssl")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (clients such as adlfs wrap the real error)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _missing(exc: BaseException) -> bool:
    return any(isinstance(e, FileNotFoundError) or type(e).__name__ == "ResourceNotFoundError"
               or any(code in str(e) for code in ("ContainerNotFound", "NoSuchBucket"))
               for e in _chain(exc))


def _denied(exc: BaseException) -> bool:
    return any(isinstance(e, PermissionError) or type(e).__name__ == "ClientAuthenticationError"
               for e in _chain(exc))


def is_transient(exc: BaseException) -> bool:
    """True for failures that may pass on a retry: network errors, timeouts, throttling, 5xx answers."""
    if _missing(exc) or _denied(exc):
        return False
    for e in _chain(exc):
        if isinstance(e, _PERMANENT):
            return False
        if isinstance(e, (OSError, TimeoutError, ConnectionError)):
            return True
        if type(e).__module__.split(".")[0] in _TRANSIENT_MODULES:
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a storage operation that failed transiently."""

    attempts: int = 4
    initial_delay: float = 0.25
    max_delay: float = 8.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")

    def call(self, fn: Callable[[], T], *, action: str, uri: str) -> T:
        """Run ``fn``; retry transient failures with jittered exponential backoff, then raise StorageError."""
        delay = self.initial_delay
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except BaseException as exc:
                if not is_transient(exc):
                    raise
                if attempt == self.attempts:
                    raise StorageError(
                        f"could not {action} {uri}: storage kept failing after {attempt} attempts "
                        f"({type(exc).__name__}: {exc}). Check the network and the storage service, then "
                        "run again; no checkpoint was lost or reported missing."
                    ) from exc
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * self.multiplier, self.max_delay)
        raise AssertionError("unreachable")  # pragma: no cover


def permanent_error(exc: BaseException, action: str, uri: str) -> BaseException:
    """A StorageError that explains a storage failure that retrying cannot fix; other errors pass unchanged."""
    if isinstance(exc, StorageError):
        return exc
    if _denied(exc):
        return StorageError(f"could not {action} {uri}: permission denied ({exc}). Check the credentials "
                            "in storage_options or the environment, and the bucket's policy.")
    if _missing(exc):
        return StorageError(f"could not {action} {uri}: the bucket, container or folder does not exist "
                            f"({exc}). Create it, or fix the URI.")
    if isinstance(exc, OSError) or any(type(e).__module__.split(".")[0] in _TRANSIENT_MODULES
                                       for e in _chain(exc)):
        return StorageError(f"could not {action} {uri}: {type(exc).__name__}: {exc}. Fix the location "
                            "(is a parent path a file? is the disk full?) and save again.")
    return exc


class Location:
    """One object (file) on an fsspec filesystem, with the operations a checkpoint needs."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None) -> None:
        options = dict(storage_options or {})
        if options.get("asynchronous"):
            raise ValueError("storage_options may not set asynchronous=True; taskpoint manages async itself")
        self.uri = uri
        self.storage_options = options
        self.retry = retry or RetryPolicy()
        try:
            self.fs, self.path = fsspec.core.url_to_fs(uri, **options)
        except ImportError as exc:
            raise ImportError(f"{uri}: {exc}. Install the matching extra, e.g. pip install 'taskpoint[s3]', "
                              "'taskpoint[gcs]' or 'taskpoint[azure]'.") from exc
        protocols = _protocols(self.fs)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_object_store = not self.is_local and bool(_OBJECT_STORES.intersection(protocols))

    def sibling(self, suffix: str) -> Location:
        """The object whose name is this one's plus ``suffix``, on the same filesystem."""
        other = object.__new__(Location)
        other.__dict__.update(self.__dict__)
        other.uri, other.path = self.uri + suffix, self.path + suffix
        return other

    # -- reads -------------------------------------------------------------------------------------------

    def exists(self) -> bool:
        def probe() -> bool:
            if self.is_local:
                return os.path.isfile(self.path)
            # Not fs.isfile(): it answers False for any error, which would report an outage as "nothing here".
            self.fs.invalidate_cache(self.path)
            try:
                return self.fs.info(self.path).get("type") == "file"  # type: ignore[no-any-return]
            except FileNotFoundError:
                return False
        return self.retry.call(probe, action="check", uri=self.uri)

    def read_small(self) -> bytes | None:
        """The whole object, or None when it does not exist. For manifests, not payloads."""
        def read() -> bytes | None:
            try:
                if self.is_local:
                    with open(self.path, "rb") as f:
                        return f.read()
                self.fs.invalidate_cache(self.path)
                return self.fs.cat_file(self.path)  # type: ignore[no-any-return]
            except (FileNotFoundError, NotADirectoryError):
                return None
        return self.retry.call(read, action="read", uri=self.uri)

    def open_read(self) -> IO[bytes]:
        """A streaming reader; FileNotFoundError when the object does not exist. Not retried here."""
        if self.is_local:
            return open(self.path, "rb", buffering=LOCAL_READ_BUFFER)
        self.fs.invalidate_cache(self.path)
        if self.is_object_store:
            size = int(self.fs.info(self.path)["size"])
            if size > 2 * RANGE_SIZE:
                return ConcurrentRangeReader(self.fs, self.path, size)  # type: ignore[return-value]
        return self.fs.open(self.path, "rb", block_size=PART_SIZE, cache_type="readahead")  # type: ignore[no-any-return]

    def container_missing(self) -> bool:
        """True when this object's bucket or container definitely does not exist (object stores only).

        Not ``fs.exists()``: it answers False for any error, which would turn an outage into "no bucket".
        """
        if not self.is_object_store:
            return False
        bucket = self.path.split("/", 1)[0]

        def probe() -> bool:
            self.fs.invalidate_cache(bucket)
            try:
                self.fs.info(bucket)
            except FileNotFoundError:
                return True
            return False

        try:
            return self.retry.call(probe, action="check", uri=self.uri)
        except (PermissionError, StorageError):
            return False

    # -- writes ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def open_write(self, size_hint: int | None = None) -> Iterator[IO[bytes]]:
        """A writer whose bytes appear at this location all at once when the block exits cleanly.

        If the block raises, or the process dies, the previous object (if any) is left untouched.
        ``size_hint`` (the size when known in advance) lets small objects go up as one request.
        """
        if self.is_local:
            with self._write_local() as f:
                yield f
        elif self.is_object_store:
            with self._write_object_store(size_hint) as f:
                yield f
        else:
            with self._write_via_move() as f:
                yield f

    @contextlib.contextmanager
    def _write_local(self) -> Iterator[IO[bytes]]:
        folder, name = os.path.split(self.path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with open(tmp, "xb+", buffering=0) as raw:
                f = _EarlyWriteback(raw)
                yield f
                f.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(folder)

    @contextlib.contextmanager
    def _write_object_store(self, size_hint: int | None = None) -> Iterator[IO[bytes]]:
        if "s3" in _protocols(self.fs) and hasattr(self.fs, "call_s3"):
            single = size_hint is not None and size_hint <= SINGLE_PUT_MAX
            writer = S3MultipartWriter(self.fs, self.path, part_size=SINGLE_PUT_MAX + 1 if single
                                       else UPLOAD_PART_SIZE)
            try:
                yield writer  # type: ignore[misc]
                writer.close()
            except BaseException:
                writer.abort()
                raise
            finally:
                self.fs.invalidate_cache(self.path)
            return
        f = self.fs.open(self.path, "wb", block_size=PART_SIZE)
        try:
            yield f
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
            self.fs.invalidate_cache(self.path)

    @contextlib.contextmanager
    def _write_via_move(self) -> Iterator[IO[bytes]]:
        tmp = f"{self.path}.{uuid.uuid4().hex[:12]}.tmp"
        parent = self.fs._parent(self.path)
        if parent:
            with contextlib.suppress(Exception):
                self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            self.fs.mv(tmp, self.path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise
        finally:
            self.fs.invalidate_cache(self.path)

    def write_small(self, data: bytes, *, action: str = "write") -> None:
        """Write ``data`` atomically, with retries. For manifests, not payloads."""
        def write() -> None:
            with self.open_write() as f:
                f.write(data)
        try:
            self.retry.call(write, action=action, uri=self.uri)
        except Exception as exc:
            mapped = permanent_error(exc, action, self.uri)
            if mapped is exc:
                raise
            raise mapped from exc

    def sweep_leftovers(self, started_before: float) -> None:
        """Remove what killed saves of this object left: temp files (local) and unfinished uploads (S3).

        Best effort. Local temp files are removed once older than :data:`LEFTOVER_GRACE_SECONDS`; S3
        multipart uploads of this exact key are aborted when they began before ``started_before`` (the
        caller's own save has committed by then). GCS resumable uploads and Azure uncommitted blocks are
        invisible and expire on their own after a week.
        """
        try:
            if self.is_local:
                folder, name = os.path.split(self.path)
                cutoff = time.time() - LEFTOVER_GRACE_SECONDS
                for entry in os.scandir(folder):
                    leftover = entry.name.startswith(f".{name}.") and entry.name.endswith(".tmp")
                    if leftover and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
            else:
                key = self.path.partition("/")[2]
                for upload_key, upload_id, initiated in self.unfinished_uploads():
                    if upload_key == key and initiated < started_before:
                        self.abort_upload(upload_key, upload_id)
        except Exception:
            pass

    def unfinished_uploads(self) -> list[tuple[str, str, float]]:
        """S3 only: the multipart uploads begun under this location's path (as a prefix) and never completed
        or aborted, as (key, upload id, initiation time); [] elsewhere. Not retried: callers sweep best-effort."""
        if "s3" not in _protocols(self.fs):
            return []
        bucket, _, prefix = self.path.partition("/")
        found: list[tuple[str, str, float]] = []
        markers: dict[str, str] = {}
        while True:
            listing = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            found += [(u["Key"], u["UploadId"], u["Initiated"].timestamp()) for u in listing.get("Uploads", [])]
            if not listing.get("IsTruncated"):
                return found
            markers = {"KeyMarker": listing["NextKeyMarker"], "UploadIdMarker": listing["NextUploadIdMarker"]}

    def abort_upload(self, key: str, upload_id: str) -> None:
        """S3 only: abort one unfinished multipart upload in this location's bucket."""
        self.fs.abort_mpu(self.path.partition("/")[0], key, upload_id)

    def remove(self) -> None:
        """Delete the object; a missing object is fine."""
        def rm() -> None:
            try:
                if self.is_local:
                    os.unlink(self.path)
                else:
                    self.fs.rm_file(self.path)
            except FileNotFoundError:
                pass
        self.retry.call(rm, action="delete", uri=self.uri)


#: Largest single write() to a local file. Large writes into fresh page-cache memory run several times
#: slower than 128 KiB ones on VMs that return freed memory to the host (measured: 16 MiB ~0.4 GB/s,
#: 128 KiB ~4 GB/s).
WRITE_PIECE = 128 << 10
#: Size of one ranged GET when a large object is read with several requests in flight.
RANGE_SIZE = 8 << 20
#: Ranged GETs in flight at once (memory: this x RANGE_SIZE).
RANGES_IN_FLIGHT = 6


class ConcurrentRangeReader(OrderedFutureReader):
    """Reads a large object as ranged GETs, several in flight, handed out in order; memory stays bounded.

    One GET stream runs at the speed of one TCP connection and one server thread; a few in parallel reach
    what the network and the server can give. A change of the object during the read shows up as a
    checksum mismatch in the caller, which then starts over.
    """

    def __init__(self, fs: Any, path: str, size: int, *, range_size: int = RANGE_SIZE,
                 in_flight: int = RANGES_IN_FLIGHT) -> None:
        super().__init__(in_flight, "taskpoint-get")
        self.size = size
        self._fs, self._path = fs, path
        self._range = range_size
        self._in_flight = in_flight
        self._next = 0

    def _fetch(self, start: int, end: int) -> bytes:
        data = self._fs.cat_file(self._path, start=start, end=end)
        if len(data) != end - start:
            raise OSError(f"short ranged read of {self._path}: {len(data)} of {end - start} bytes")
        return data  # type: ignore[no-any-return]

    def _fill(self) -> None:
        while self._next < self.size and len(self._pending) < self._in_flight:
            end = min(self._next + self._range, self.size)
            self._pending.append(self._pool.submit(self._fetch, self._next, end))
            self._next = end


#: Size of the parts of taskpoint's own S3 multipart uploads (S3 allows 10,000 parts: 80 GB at this size;
#: the part size doubles every 1,000 parts so that any checkpoint fits).
UPLOAD_PART_SIZE = 8 << 20
#: Objects of known size up to this go up as one PUT (fewer requests than a multipart upload).
SINGLE_PUT_MAX = 64 << 20
#: Parts of a multipart upload in flight at once (memory: this x the part size).
PARTS_IN_FLIGHT = 4


class S3MultipartWriter(io.RawIOBase):
    """Uploads to S3 with several parts in flight, so compression and upload overlap; atomic by protocol.

    Up to one part of data is a single PUT. Beyond that a multipart upload is started, each full part is
    sent by a pool (at most :data:`PARTS_IN_FLIGHT`, so memory stays bounded), and ``close()`` completes the
    upload: the object appears whole, at that moment. ``abort()`` aborts the upload: S3 keeps no parts.
    """

    def __init__(self, fs: Any, path: str, *, part_size: int = UPLOAD_PART_SIZE,
                 in_flight: int = PARTS_IN_FLIGHT):
        super().__init__()
        import concurrent.futures

        self._fs = fs
        self._bucket, _, self._key = path.partition("/")
        self._part_size = part_size
        self._in_flight = in_flight
        self._pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="taskpoint-put")
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
            started = self._fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
            self._upload_id = started["UploadId"]
        number = len(self._parts) + 1
        # Bounded: settle the oldest parts (raising a failed one's error) until another may leave memory's
        # reach. A deque of the unsettled ones keeps this O(1) per part, also for 10,000-part uploads.
        while self._unsettled and (self._unsettled[0].done() or len(self._unsettled) >= self._in_flight):
            self._unsettled.popleft().result()
        future = self._pool.submit(self._upload_part, number, data)
        self._parts.append(future)
        self._unsettled.append(future)

    def _upload_part(self, number: int, data: bytes) -> dict[str, Any]:
        answer = self._fs.call_s3("upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                                  PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._upload_id is None:
                self._fs.call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                parts = [f.result() for f in self._parts]
                self._fs.call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                                 UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        finally:
            self._buf = bytearray()
            self._pool.shutdown(wait=True)
            super().close()

    def abort(self) -> None:
        """Drop the upload; nothing becomes visible and no parts are kept."""
        if self.closed:
            return
        for f in self._parts:
            f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # the caller's error is the one to report
                self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                 UploadId=self._upload_id)
        self._buf = bytearray()
        super().close()


class _EarlyWriteback(io.BufferedWriter):
    """A buffered file that asks the kernel to start writing each flushed stretch to disk right away.

    Without it, gigabytes sit dirty in the page cache and the final fsync writes them all while the save
    waits; with it, the disk works while the data is still being compressed, and the fsync finds little.
    """

    _KICK = 32 << 20

    def __init__(self, raw: Any) -> None:
        super().__init__(raw, buffer_size=WRITE_PIECE)
        self._fd = raw.fileno()
        self._kicked = 0

    def flush(self) -> None:
        super().flush()
        written = self.raw.tell()
        if written - self._kicked >= self._KICK and hasattr(os, "posix_fadvise"):
            # POSIX_FADV_DONTNEED starts writeback of the range's dirty pages without waiting for it.
            os.posix_fadvise(self._fd, self._kicked, written - self._kicked, os.POSIX_FADV_DONTNEED)
            self._kicked = written

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        for start in range(0, view.nbytes, WRITE_PIECE):
            super().write(view[start:start + WRITE_PIECE])
        if self.raw.tell() - self._kicked >= self._KICK:
            self.flush()
        return view.nbytes


def copy_file_in_kernel(source: str | os.PathLike[str], dest_fd: int) -> int:
    """Copy a whole file (to its end, even if it grows meanwhile) into ``dest_fd`` at its position, without
    passing the bytes through Python; return how many bytes were copied."""
    with open(source, "rb") as src:
        return copy_fd_in_kernel(src.fileno(), dest_fd)


def digest_by_reading(fd: int, size: int, hasher: Any) -> int:
    """Feed up to ``size`` bytes of an open file to ``hasher`` with positional reads into one small buffer;
    return how many there were. For files others could truncate meanwhile: a memory map would crash the
    process with SIGBUS, a read just comes up short."""
    piece = 1 << 20
    done = 0
    if not hasattr(os, "preadv"):  # e.g. macOS before 11: a new bytes object per piece
        while done < size and (chunk := os.pread(fd, min(piece, size - done), done)):
            hasher.update(chunk)
            done += len(chunk)
        return done
    view = memoryview(bytearray(piece))
    while done < size:
        n = os.preadv(fd, [view[:min(piece, size - done)]], done)
        if n == 0:
            break
        hasher.update(view[:n])
        done += n
    return done


def copy_fd_in_kernel(source_fd: int, dest_fd: int, size: int | None = None) -> int:
    """Copy the first ``size`` bytes of ``source_fd`` (all of it when None), read by offset so its position
    is left alone, to ``dest_fd`` at its position; return how many bytes there were (fewer when the source
    is shorter)."""
    limit = sys.maxsize if size is None else size
    copied = 0
    try:
        while copied < limit:
            n = os.copy_file_range(source_fd, dest_fd, min(limit - copied, 1 << 30), copied)
            if n == 0:
                return copied
            copied += n
        return copied
    except (AttributeError, OSError):  # no copy_file_range here, or not between these filesystems
        while copied < limit:
            chunk = os.pread(source_fd, min(WRITE_PIECE, limit - copied), copied)
            if not chunk:
                break
            copied += os.write(dest_fd, chunk)
    return copied


def copy_with_metadata(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """``shutil.copy2`` with the bytes copied in the kernel, and an error if the source changes size meanwhile."""
    size = os.stat(source).st_size
    with open(dest, "wb") as out:
        copied = copy_file_in_kernel(source, out.fileno())
    if copied != size or os.stat(source).st_size != size:
        raise RuntimeError(f"{source} changed size while it was being copied; save it again once it is complete")
    shutil.copystat(source, dest)


class ParallelCopy:
    """Copies files on a few threads at once: a 1 GiB folder of four files in ~0.26 s instead of ~0.37 s.

    Use it as ``shutil.copytree``'s ``copy_function`` (each call only queues the copy), inside a ``with``
    block or followed by :meth:`finish`: both wait for every copy and raise the first error (a ``with``
    block that is already raising only waits, so no copy still writes once it is left). Copies get the
    source's metadata, as with ``shutil.copy2``, and are made in the kernel (``copy_file_range``: a reflink
    where the filesystem can). Files are copied whole: parallel writes into one file serialize on its inode
    lock (ext4, xfs).
    """

    def __init__(self, threads: int | None = None) -> None:
        import concurrent.futures

        self._pool = concurrent.futures.ThreadPoolExecutor(threads or max(1, min(os.cpu_count() or 1, 4)),
                                                           thread_name_prefix="taskpoint-copy")
        self._jobs: list[concurrent.futures.Future[None]] = []

    def __call__(self, source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> str:
        self._jobs.append(self._pool.submit(copy_with_metadata, source, dest))
        return os.fspath(dest)

    def finish(self) -> None:
        """Wait for every queued copy and raise the first error."""
        try:
            for job in self._jobs:
                job.result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ParallelCopy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            with contextlib.suppress(Exception):
                self.finish()


#: Window of a file mapped at once while hashing it (bounds the resident memory the mapping adds).
_HASH_WINDOW = 64 << 20


def digest_of_fd(fd: int, size: int, hasher: Any) -> Any:
    """Feed the first ``size`` bytes of an open file to ``hasher`` through memory maps (no copies)."""
    import mmap

    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the window in at once
    for offset in range(0, size, _HASH_WINDOW):
        length = min(_HASH_WINDOW, size - offset)
        with mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ, offset=offset) as view:
            hasher.update(view)
    return hasher


def _protocols(fs: Any) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def normalize_uri(value: str | os.PathLike[str], what: str) -> str:
    """A URI string from a str or PathLike; a TypeError names ``what`` for anything else."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str URI or an os.PathLike, not {type(value).__name__}")
    return value
