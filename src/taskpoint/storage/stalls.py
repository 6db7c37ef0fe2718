"""Transfers that stop moving: one part of an upload, or one ranged read of a large object, that makes no
progress for a bounded time is abandoned and sent again, until the operation's deadline; then
:class:`TransferStalled` names the object and the part or byte range.

Without this a stalled part (a connection the store keeps open and never answers: a report had 900 GB uploads
stall until the job's collective timeout) waits out the whole retry deadline, and the error says neither which
object nor which part.

What counts as progress:

- An S3 part or single PUT through s3fs (:func:`until_stalled`): each piece of its body the HTTP client takes.
  aiobotocore hands a file-like body to aiohttp, which reads it 256 KiB at a time and reads the next piece only
  once the socket has taken the last: a request is abandoned when no piece was taken for the stall timeout
  (``RetryPolicy.stall_timeout``, default :data:`STALL_TIMEOUT`), or when, after its last piece, the bytes still
  in the socket's buffers (up to the kernel's send buffer, 4 MiB by default on Linux) and the store's answer took
  longer than that. So a part that moves slowly but moves is never abandoned, whatever its size, and one that
  stops is abandoned within the stall timeout of its last piece. (Measured through the fault proxy at 2 MiB/s:
  botocore reads the 8 MiB body twice up front for its checksums, aiohttp then takes 4 MiB at once, into the
  socket's buffers, and a piece every 0.13 s after.)
- Any other transfer (a ranged read, an upload through another client) is one :data:`PROGRESS_UNIT`: a request of
  that size or less is abandoned when it has not been answered within the stall timeout; a larger one is given
  that time per unit. At the default, such a request is abandoned only when it moved less than 8 MiB a minute
  (140 KB/s), far below what one connection to a store gives (moto on this machine: 165 MB/s).
"""

from __future__ import annotations

import asyncio
import errno
import io
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .._log import logger
from .deadline import Deadline

T = TypeVar("T")

#: Seconds without progress after which one transfer (a part, a ranged read) is abandoned and sent again
#: (``RetryPolicy.stall_timeout``): botocore's own read timeout, so that no answer is given up on sooner than
#: the client would have itself; a rank then learns of a stalled part in a minute, not at the retry deadline.
STALL_TIMEOUT = 60.0
#: The bytes a transfer must move within the stall timeout: the parts of an upload and the ranges of a read.
PROGRESS_UNIT = 8 << 20


class TransferStalled(TimeoutError):
    """One transfer (``what``: the part or byte range, and the object) was abandoned after making no progress,
    each time it was sent, until the operation's deadline passed. A TimeoutError (``ETIMEDOUT``): transient, so
    the retry policy reports it as the last failure of :class:`~taskpoint.errors.StorageUnavailable`."""

    def __init__(self, what: str, window: float, tries: int, deadline: Deadline) -> None:
        until = f"the retry deadline of {deadline.seconds:g} s" if deadline.seconds is not None else "the deadline"
        super().__init__(errno.ETIMEDOUT, f"{what} made no progress before {until} passed ({tries} tries, each "
                                          f"abandoned after at most {window:g} s without an answer)")
        self.what = what


class TransferFailed(OSError):
    """A transient failure of one transfer, naming it (``what``: the part or byte range, and the object) where the
    client's own error does not: obstore's names the request's URL without its query (which holds the part's
    number, and is cut from messages for the signatures it may carry), and no byte range. Transient like the
    failure it wraps (its ``__cause__``, where the error map and the throttling checks still read it)."""

    def __init__(self, what: str, exc: BaseException) -> None:
        super().__init__(errno.EIO, f"{what}: {type(exc).__name__}: {exc}")
        self.what = what


def window(stall: float, size: int) -> float:
    """How long a request moving ``size`` bytes may go unanswered: ``stall`` per :data:`PROGRESS_UNIT`."""
    return stall * max(1, math.ceil(size / PROGRESS_UNIT))


class MeteredBody(io.BytesIO):
    """A request body whose reads are its transfer's progress: :attr:`moved` is when the last one came (the HTTP
    client reads a piece when the socket has taken the one before, see the module's doc)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.moved = time.monotonic()

    def read(self, size: int | None = -1) -> bytes:
        self.moved = time.monotonic()
        return super().read(size)


async def until_stalled(start: Callable[[], Awaitable[T]], body: MeteredBody, stall: float) -> T:
    """Await ``start()``, a request that sends ``body``; abandon it (cancelled, TimeoutError) once nothing has
    read ``body`` for ``stall`` seconds and no answer came."""
    task = asyncio.ensure_future(start())
    try:
        while True:
            idle = time.monotonic() - body.moved
            if idle >= stall:
                raise TimeoutError(errno.ETIMEDOUT, f"no piece of the body taken and no answer for {idle:.1f} s")
            done, _ = await asyncio.wait({task}, timeout=stall - idle)
            if done:
                return task.result()
    finally:
        task.cancel()  # a no-op once it is done


def _gave_up(exc: BaseException) -> bool:
    """True when ``exc`` is a call cancelled by its timeout (fsspec's FSTimeoutError, asyncio's, the builtin)."""
    return isinstance(exc, (TimeoutError, asyncio.TimeoutError)) and not isinstance(exc, TransferStalled)


def watched(call: Callable[[Deadline], T], *, what: str, size: int, deadline: Deadline, stall: float,
            metered: bool = False) -> T:
    """``call(attempt)``, one transfer of ``size`` bytes, whose requests end by ``attempt``: the earlier of
    ``deadline`` and :func:`window` from now, or ``deadline`` itself where the call is ``metered`` (it abandons
    its request after ``stall`` seconds without progress itself: :func:`until_stalled`). A call that times out
    before ``deadline`` is abandoned (logged) and made again; once ``deadline`` has passed,
    :class:`TransferStalled` names ``what``. Every other failure is raised as it is. ``call`` must be safe to
    repeat (a part or a range, sent again whole)."""
    limit = stall if metered else window(stall, size)
    tries = 0
    while True:
        tries += 1
        began = time.monotonic()
        try:
            return call(deadline if metered else Deadline.from_seconds(limit).min(deadline))
        except Exception as exc:
            if not _gave_up(exc):
                raise
            if deadline.expired:
                # Raised outside the handler, so the client's timeout is not what the error map reads.
                stalled = exc
            else:
                logger.warning("taskpoint: %s made no progress for %.1f s: abandoned, sending it again (try %d)",
                               what, time.monotonic() - began, tries + 1)
                continue
        raise TransferStalled(what, limit, tries, deadline) from stalled
