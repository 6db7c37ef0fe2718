"""Stream helpers shared by the readers: a stream fed by futures resolved in order (the shape of parallel
inflate and ranged GETs), a loop over short reads, and the concurrent ranged reader of large remote objects."""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import io
from collections.abc import Callable, Sized
from typing import IO, Any, TypeVar

from ..executors import IO as IO_POOL
from ..executors import Lane
from .deadline import NO_DEADLINE, Deadline, bounded
from .stalls import STALL_TIMEOUT, watched


def read_up_to(source: IO[bytes], n: int) -> bytes:
    """``n`` bytes of ``source``, fewer only at its end (a single ``read`` may return less at any time)."""
    parts, got = [], 0
    while got < n:
        chunk = source.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


#: What a ranged fetch returns: bytes, or a client's own buffer (obstore's ``Bytes``).
Data = TypeVar("Data", bound=Sized)

#: What one future of an :class:`OrderedFutureReader` yields: a buffer, or buffers to serve one after the other.
Result = bytes | memoryview | list[bytes | memoryview]


class OrderedFutureReader(io.RawIOBase):
    """Serves the results of futures, oldest first, while subclasses keep a bounded number in flight.

    ``lane`` is the shared pool's lane the work runs on (:mod:`taskpoint.executors`). Subclasses implement
    :meth:`_fill` (submit work to ``self._pool`` and append the futures to
    ``self._pending`` until enough are in flight or the input is exhausted), or, when their futures arrive some
    other way, :meth:`_next_result` itself. A result is one buffer or a list of buffers served in order (the
    data of a stored gzip member's blocks, sliced out of the member): :meth:`read_view` hands them out without
    copying, :meth:`readinto` copies.
    """

    def __init__(self, lane: Lane) -> None:
        super().__init__()
        self._pool = lane
        self._pending: collections.deque[concurrent.futures.Future[Result]] = collections.deque()
        self._out = memoryview(b"")
        self._queued: collections.deque[memoryview] = collections.deque()

    def _fill(self) -> None:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def _next_result(self) -> Result | None:
        """The next result in order (waiting for it), None at the end."""
        self._fill()
        if not self._pending:
            return None
        result = self._pending.popleft().result()
        self._fill()
        return result

    def read_view(self, n: int) -> memoryview:
        """The next up to ``n`` bytes (at least one; none only at the end) as a read-only view of a result, not
        a copy: it stays valid after later reads, since it keeps its result alive."""
        while not self._out:
            if self._queued:
                self._out = self._queued.popleft()
                continue
            result = self._next_result()
            if result is None:
                return self._out
            if isinstance(result, list):
                self._queued.extend(memoryview(piece) for piece in result)
            else:
                self._out = memoryview(result)
        view, self._out = self._out[:n], self._out[n:]
        return view.toreadonly()

    def readinto(self, buf: Any) -> int:
        """Copies the rest of the current result into ``buf`` (as much as fits), waiting for the next result only
        when none is left: as one read returned up to a whole result when each was a single buffer."""
        n = 0
        while n < len(buf) and (not n or self._out or self._queued):
            view = self.read_view(len(buf) - n)
            if not view:
                break
            buf[n:n + len(view)] = view
            n += len(view)
        return n

    def close(self) -> None:
        if not self.closed:
            for future in self._pending:
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()


#: Size of one ranged GET when a large object is read with several requests in flight.
RANGE_SIZE = 8 << 20
#: Ranged GETs in flight at once (memory: this x RANGE_SIZE).
RANGES_IN_FLIGHT = 6


class ObjectChanged(OSError):
    """The object was replaced while it was being read (its version no longer matches the one the read was
    pinned to). Transient (``ESTALE``): the retry policy starts the read over, from the new version."""

    def __init__(self, path: str, version: str) -> None:
        super().__init__(errno.ESTALE, f"{path} was replaced while it was being read (it was version {version}); "
                                       "reading it again from the start")


class VersionConflict(Exception):
    """A conditional write found the object at another version than the one it was given (another writer
    changed it since it was read). Not a storage failure: the caller reads the object again and decides."""


class ConcurrentRangeReader(OrderedFutureReader):
    """Reads a large object as ranged GETs, several in flight, handed out in order; memory stays bounded.

    One GET stream runs at the speed of one TCP connection and one server thread; a few in parallel reach
    what the network and the server can give. ``version`` is the object's version when the read began;
    subclasses for stores that can pin ranged reads to it (S3's ETag, GCS's generation: see the backends)
    raise :class:`ObjectChanged` when the object changed, and the read starts over. Elsewhere (Azure) a change
    shows up as a size or checksum mismatch.

    ``cap``: the store's cap on requests in flight (:meth:`~taskpoint.storage.throttle.Pushback.cap`).
    ``deadline``: that of the retried operation the read belongs to; each range, fetched on a pool thread, is
    given the time left before it, and is sent again when it made no progress for ``stall`` seconds
    (:func:`~.stalls.watched`, which names its byte range once the deadline passes). Subclasses fetch one
    range in :meth:`_fetch_range`. ``on_received``, when set before the first read, is told of the bytes of
    each range as they arrive (subclasses that stream a range tell it piece by piece): a load's progress,
    ahead of what was read.
    """

    on_received: Callable[[int], None] | None = None

    def __init__(self, fs: Any, path: str, size: int, *, version: str | None = None, range_size: int = RANGE_SIZE,
                 in_flight: int = RANGES_IN_FLIGHT, deadline: Deadline = NO_DEADLINE,
                 cap: Callable[[int], int] | None = None, stall: float = STALL_TIMEOUT) -> None:
        super().__init__(IO_POOL.lane(in_flight, cap))
        self.size = size
        self.version = version
        self.deadline = deadline
        self.stall = stall
        self._fs, self._path = fs, path
        #: The object's URL, as errors name it.
        self.uri: str = fs.unstrip_protocol(path) if hasattr(fs, "unstrip_protocol") else path
        self._range = range_size
        self._in_flight = in_flight
        self._next = 0

    def _fetch(self, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the object, sent again while they make no progress."""
        return watched(lambda attempt: self._fetch_range(start, end, attempt), size=end - start,
                       what=f"bytes {start}-{end - 1} of {self.uri}", deadline=self.deadline, stall=self.stall)

    def _fetch_range(self, start: int, end: int, deadline: Deadline) -> bytes:
        """One request for bytes ``start`` to ``end``, ending by ``deadline``."""
        data: bytes = self._fs.cat_file(self._path, start=start, end=end, **bounded(self._fs, deadline))
        return self._arrived(data, start, end)

    def _arrived(self, data: Data, start: int, end: int, *, counted: bool = False) -> Data:
        """``data``, the whole range ``start`` to ``end`` (OSError when it came short), told to
        :attr:`on_received` unless the fetch ``counted`` it piece by piece as it streamed."""
        if len(data) != end - start:
            raise OSError(f"short ranged read of {self._path}: {len(data)} of {end - start} bytes")
        if not counted:
            self._received(len(data))
        return data

    def _received(self, n: int) -> None:
        if self.on_received is not None:
            self.on_received(n)

    def _fill(self) -> None:
        while self._next < self.size and len(self._pending) < self._in_flight:
            end = min(self._next + self._range, self.size)
            self._pending.append(self._pool.submit(self._fetch, self._next, end))
            self._next = end
