"""Stream helpers shared by the readers: a stream fed by futures resolved in order (the shape of parallel
inflate and ranged GETs), and a loop over short reads."""

from __future__ import annotations

import collections
import concurrent.futures
import io
from typing import IO, Any


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


class OrderedFutureReader(io.RawIOBase):
    """Serves the results of futures, oldest first, while subclasses keep a bounded number in flight.

    Subclasses implement :meth:`_fill` (submit work to ``self._pool`` and append the futures to
    ``self._pending`` until enough are in flight or the input is exhausted).
    """

    def __init__(self, workers: int, name: str) -> None:
        super().__init__()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._pending: collections.deque[concurrent.futures.Future[bytes]] = collections.deque()
        self._out = memoryview(b"")

    def _fill(self) -> None:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self._out:
            self._fill()
            if not self._pending:
                return 0
            self._out = memoryview(self._pending.popleft().result())
            self._fill()
        n = min(len(buf), len(self._out))
        buf[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            for future in self._pending:
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()
