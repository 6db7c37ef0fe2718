"""A labelled gzip stream read from a local file by positional reads, its stored members copied by the kernel.

A manager step restored from local disk is checked whole by its digest, hashed from the same file on a thread of
its own, before anything extracted from it is published (:func:`taskpoint.extraction.extract_file`). So the data of
its stored members (what did not compress: weights) need not pass through Python: :class:`FileGzipReader` cuts the
stream into members by reading only their headers and trailers and their stored blocks' headers
(:func:`~.stored.stored_spans`), and :meth:`FileGzipReader.copy_into` has the kernel copy the blocks' data from the
file to the destination (``os.sendfile``: any two files, also on two file systems). Members that were compressed
are read and inflated on the CPU pool, several ahead, and checked by their CRC32, as
:class:`~.pgzip.ParallelGzipReader` does; stored members' CRC32 is left to the digest of the same bytes.

No memory map: a file truncated meanwhile would kill the process (SIGBUS); here a read or a copy comes up short and
raises EOFError.
"""

from __future__ import annotations

import collections
import concurrent.futures
import io
import os
from typing import Any

from ..executors import CPU
from .pgzip import HEADER_SIZE, TRAILER_SIZE, GzipFormatError, member_data, member_length, trailer
from .stored import STORED_HEADER, stored_spans

#: What a member is to the reader: the (offset, length) spans of a stored member's data in the file, or the
#: inflation of a compressed one.
_Member = list[tuple[int, int]] | concurrent.futures.Future[list[bytes | memoryview]]
#: Most views of inflated data written by one ``os.writev``.
_MAX_VIEWS = 64


class DestinationError(Exception):
    """Writing to the destination failed (``original``: the OSError), not reading the stored file."""

    def __init__(self, original: OSError) -> None:
        super().__init__(str(original))
        self.original = original


class FileGzipReader(io.RawIOBase):
    """The plain bytes of the labelled gzip stream that fills the first ``size`` bytes of the open local file
    ``fd``, read by offset (the file's position is left alone). Up to 2 x ``threads`` members are cut ahead;
    GzipFormatError for a stream that is not labelled gzip, EOFError for a file that ends inside a member."""

    def __init__(self, fd: int, size: int, *, threads: int | None = None) -> None:
        super().__init__()
        threads = threads or CPU.threads
        self._fd, self._size, self._pos = fd, size, 0
        self._pool = CPU.lane(threads)
        self._ahead: collections.deque[_Member] = collections.deque()
        self._limit = 2 * threads
        self._spans: collections.deque[tuple[int, int]] = collections.deque()  # left of the current stored member
        self._views: collections.deque[memoryview] = collections.deque()  # left of the current inflated member
        self._kernel = True  # os.sendfile works between the two files

    def readable(self) -> bool:
        return True

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) < n:
            raise EOFError(f"the stored object ends at byte {offset + len(data)}, inside a gzip member: it is "
                           f"shorter than the {self._size} bytes it had when the read began")
        return data

    def _cut(self) -> _Member:
        """The next member, from where the previous one ended."""
        start = self._pos
        total = member_length(self._pread(min(HEADER_SIZE, self._size - start), start))
        if start + total > self._size:
            raise EOFError("compressed stream ended inside a member")
        self._pos = start + total
        body, end = start + HEADER_SIZE, start + total - TRAILER_SIZE
        isize = trailer(self._pread(TRAILER_SIZE, end))[1]
        spans = stored_spans(lambda pos: self._pread(min(STORED_HEADER, end - body - pos), body + pos), end - body)
        if spans is None:
            return self._pool.submit(member_data, self._pread(total - HEADER_SIZE, body), False)
        if sum(length for _, length in spans) != isize:
            raise GzipFormatError("gzip member fails its CRC32 or length check")
        return [(body + pos, length) for pos, length in spans]

    def _current(self) -> bool:
        """Make the next member current once the current one is used up; False at the end of the stream."""
        while not self._spans and not self._views:
            while len(self._ahead) < self._limit and self._pos < self._size:
                self._ahead.append(self._cut())
            if not self._ahead:
                return False
            member = self._ahead.popleft()
            if isinstance(member, list):
                self._spans.extend(member)
            else:
                self._views.extend(memoryview(piece) for piece in member.result() if len(piece))
        return True

    def _used_span(self, n: int) -> None:
        offset, length = self._spans[0]
        if n == length:
            self._spans.popleft()
        else:
            self._spans[0] = (offset + n, length - n)

    def _used_views(self, n: int) -> None:
        while n and n >= len(self._views[0]):
            n -= len(self._views.popleft())
        if n:
            self._views[0] = self._views[0][n:]

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = 0
        while n < len(view) and self._current():
            if self._views:
                piece = self._views[0][:len(view) - n]
                view[n:n + len(piece)] = piece
                self._used_views(len(piece))
                n += len(piece)
            else:
                offset, length = self._spans[0]
                data = self._pread(min(length, len(view) - n), offset)
                view[n:n + len(data)] = data
                self._used_span(len(data))
                n += len(data)
        return n

    def copy_into(self, fd: int, n: int) -> int:
        """Write the next up to ``n`` bytes of the stream to ``fd`` at its position, the data of stored members
        copied by the kernel; return how many (none only at the end of the stream). DestinationError when writing
        fails; a failure to read the stored file is raised as it is."""
        done = 0
        while done < n and self._current():
            if self._views:
                views: list[memoryview] = []
                got = 0
                for view in self._views:
                    if got == n - done or len(views) == _MAX_VIEWS:
                        break
                    views.append(view[:n - done - got])
                    got += len(views[-1])
                try:
                    written = os.writev(fd, views)
                except OSError as exc:
                    raise DestinationError(exc) from exc
                self._used_views(written)
            else:
                offset, length = self._spans[0]
                written = self._send(fd, offset, min(length, n - done))
                self._used_span(written)
            done += written
        return done

    def _send(self, fd: int, offset: int, length: int) -> int:
        """Copy up to ``length`` bytes of the stored file from ``offset`` to ``fd``: by ``os.sendfile`` while it
        works between the two, else (and to tell which side failed) by a read and a write."""
        if self._kernel:
            try:
                sent = os.sendfile(fd, self._fd, offset, length)
            except OSError:  # not between these files, or a failure that the read and write below name
                self._kernel = False
            else:
                if sent:
                    return sent  # else the file may end here: the read below says so
        data = self._pread(length, offset)
        try:
            return os.write(fd, data)
        except OSError as exc:
            raise DestinationError(exc) from exc

    def close(self) -> None:
        if not self.closed:
            for member in self._ahead:
                if not isinstance(member, list):
                    member.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()
