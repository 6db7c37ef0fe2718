"""Two thread pools per process, :data:`IO` and :data:`CPU`, shared by every operation through *lanes*.

An operation (one stream's ranged GETs, one upload's parts, one gzip stream's members) takes a
:meth:`SharedPool.lane` of the width it used to give its own pool: its tasks run on the shared threads, at
most ``width`` of them at once, and the rest wait in the lane, not in the pool, so that a wide operation
cannot hold the pool's queue against the others. The pools start their threads on first use and keep them:
concurrent operations no longer multiply threads (each with its own malloc arena), and the process has one
bound on them. Sizes: ``TASKPOINT_IO_THREADS`` (default :data:`DEFAULT_IO_THREADS`) and
``TASKPOINT_CPU_THREADS`` (default: the cores this process may run on).

Only *leaf* tasks go on these pools: tasks that never wait for other tasks of the same pool (reading a
range, uploading a part, compressing or inflating a member, hashing a piece). A task that submits work and
waits for it (a *coordinator*: one file's download, which reads through ranged GETs) could hold every thread
of a bounded pool while what it waits for queues behind it; coordinators keep their own small pools. As a
safeguard, a task submitted from one of the pool's own threads runs at once in that thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

IO_THREADS_ENV = "TASKPOINT_IO_THREADS"
CPU_THREADS_ENV = "TASKPOINT_CPU_THREADS"
#: Threads of the I/O pool by default: room for several operations' requests in flight at once (a load's
#: ranged GETs, a save's parts), which spend their time waiting on the network, not on a core.
DEFAULT_IO_THREADS = 64


def cores() -> int:
    """The cores this process may run on (its affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
        return os.cpu_count() or 1


def threads_from_env(variable: str, default: int) -> int:
    """The number of threads the environment variable ``variable`` asks for, ``default`` when it is unset or
    empty; ValueError naming the variable when it is not a whole number of at least 1."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        threads = int(raw)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not a number of threads: set it to a whole number of at "
                         "least 1, or unset it for the default") from None
    if threads < 1:
        raise ValueError(f"{variable}={raw!r}: a pool needs at least 1 thread; unset it for the default")
    return threads


_worker = threading.local()  # .pool: the SharedPool whose thread this is
_pools: weakref.WeakSet[SharedPool] = weakref.WeakSet()


class SharedPool:
    """One process-wide pool of ``threads_from_env(variable, default())`` threads, started on first use."""

    def __init__(self, name: str, variable: str, default: Callable[[], int]) -> None:
        self.name, self.variable, self._default = name, variable, default
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        _pools.add(self)

    @property
    def threads(self) -> int:
        """The pool's size, as the environment says now (read again when the pool starts)."""
        return threads_from_env(self.variable, self._default())

    def lane(self, width: int, cap: Callable[[int], int] | None = None) -> Lane:
        """A view of this pool for one operation that keeps at most ``width`` of its tasks in flight, or
        ``cap(width)`` as it says at each moment (a store that pushes back: fewer requests in flight)."""
        return Lane(self, width, cap)

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> concurrent.futures.Future[Any]:
        """Put ``fn(*args)`` on the pool's queue (lanes do this; operations use a lane)."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix=f"taskpoint-{self.name}", initializer=self._mark)
            executor = self._executor
        return executor.submit(fn, *args)

    def _mark(self) -> None:
        _worker.pool = self

    def owns_this_thread(self) -> bool:
        return getattr(_worker, "pool", None) is self

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's threads do not exist here, so the next use starts new ones."""
        self._lock = threading.Lock()
        self._executor = None


def _forget_pools_after_fork() -> None:
    for pool in list(_pools):
        pool._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)

IO = SharedPool("io", IO_THREADS_ENV, lambda: DEFAULT_IO_THREADS)
CPU = SharedPool("cpu", CPU_THREADS_ENV, cores)


def _run(future: concurrent.futures.Future[T], fn: Callable[..., T], args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> None:
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # handed to whoever waits on the future, as ThreadPoolExecutor does
        future.set_exception(exc)
    else:
        future.set_result(result)


class Lane(concurrent.futures.Executor):
    """One operation's share of a :class:`SharedPool`: an :class:`~concurrent.futures.Executor` (``submit``,
    ``map``, ``shutdown``, a ``with`` block that waits for its tasks) that keeps at most ``width`` of its tasks
    on the pool at once and the others queued here, in order. :meth:`cancel` drops what is still queued.
    ``cap``, where given, lowers the width while it says so (asked each time a task could start)."""

    def __init__(self, pool: SharedPool, width: int, cap: Callable[[int], int] | None = None) -> None:
        if width < 1:
            raise ValueError(f"a lane needs a width of at least 1, got {width}")
        self.pool, self.width, self._cap = pool, width, cap
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...],
                                             dict[str, Any]]] = collections.deque()
        self._running = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a lane that was shut down")
            nested = self.pool.owns_this_thread()
            if not nested:
                self._queue.append((future, fn, args, kwargs))
        if nested:  # waiting for it here could hold the last thread of the pool: run it now instead
            if future.set_running_or_notify_cancel():
                _run(future, fn, args, kwargs)
        else:
            self._pump()
        return future

    def _pump(self) -> None:
        """Move queued tasks to the pool while fewer than ``width`` are there."""
        while True:
            with self._lock:
                if self._running >= (self.width if self._cap is None else self._cap(self.width)) or not self._queue:
                    return
                future, fn, args, kwargs = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue  # cancelled while it waited
                self._running += 1
            try:
                self.pool.submit(self._task, future, fn, args, kwargs)
            except BaseException as exc:  # the pool refuses work (a bad size, the interpreter exiting)
                future.set_exception(exc)
                with self._lock:  # and the next queued task is tried, in this loop
                    self._running -= 1
                    self._idle.notify_all()

    def _task(self, future: concurrent.futures.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        try:
            _run(future, fn, args, kwargs)
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._lock:
            self._running -= 1
            self._idle.notify_all()
        self._pump()

    def cancel(self) -> int:
        """Cancel the tasks still queued in this lane (those on the pool run to their end); how many."""
        with self._lock:
            queued, self._queue = list(self._queue), collections.deque()
            self._idle.notify_all()
        return sum(1 for future, *_ in queued if future.cancel())

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more tasks; with ``cancel_futures`` the queued ones are cancelled; with ``wait``, returns once the
        lane's tasks have ended. The shared pool's threads stay for other operations."""
        with self._lock:
            self._closed = True
        if cancel_futures:
            self.cancel()
        if wait:
            with self._idle:
                while self._running or self._queue:
                    self._idle.wait()
