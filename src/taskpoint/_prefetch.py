"""A readable stream fed by futures resolved in order: the shape shared by parallel inflate and ranged GETs."""

from __future__ import annotations

import collections
import concurrent.futures
import io
from typing import Any


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
