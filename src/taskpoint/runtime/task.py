"""The task decorator: each call runs the function with retries, each attempt in its own context."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, overload

import anyio
import anyio.to_thread

from .. import preemption
from ..errors import Preempted, add_note
from ..ranks import ranks_from_environment
from .layout import ENV_RUN_NAME, clean_name, default_root, env_storage_options
from .lineage import ActionStore
from .state import TaskContext, active, current, reset_context, set_context

_log = logging.getLogger("taskpoint")

F = TypeVar("F", bound=Callable[..., Any])


_calls_lock = threading.Lock()
_calls: dict[tuple[str, str, str], int] = {}


def _action_for(run_name: str, parent: str, name: str) -> str:
    """``name`` for a task's first call inside a parent task, then ``name-2``, ``name-3``...

    Calls are counted per process, so a rerun that makes the same calls in the same order maps each call
    to the same action, and resumes it.
    """
    with _calls_lock:
        count = _calls.get((run_name, parent, name), 0) + 1
        _calls[(run_name, parent, name)] = count
    return name if count == 1 else f"{name}-{count}"


def _new_run_name(action: str) -> str:
    return f"{action}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


class _TaskSpec:
    def __init__(self, fn: Callable[..., Any], retries: int, retry_on: tuple[type[BaseException], ...],
                 name: str | None, root: str | None, run_name: str | None,
                 storage_options: dict[str, Any] | None, checkpoints: dict[str, Any] | None = None,
                 preemption: bool = True, save_on_preemption: Callable[[], Any] | None = None) -> None:
        if save_on_preemption is not None and not callable(save_on_preemption):
            raise TypeError("save_on_preemption must be a function returning the state to save, not "
                            f"{type(save_on_preemption).__name__}")
        self.preemption = bool(preemption)
        self.save_on_preemption = save_on_preemption
        self.install()
        if checkpoints is not None and not isinstance(checkpoints, dict):
            raise TypeError("checkpoints must be a dict of CheckpointManager options, not "
                            f"{type(checkpoints).__name__}")
        if checkpoints and ("directory" in checkpoints or "storage_options" in checkpoints):
            raise ValueError("checkpoints= sets manager options (keep, keep_every, codec, async_save, ...); the "
                             "directory and storage options come from the task's root")
        self.checkpoints = checkpoints
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if isinstance(retry_on, type):
            retry_on = (retry_on,)
        if not all(isinstance(t, type) and issubclass(t, BaseException) for t in retry_on):
            raise TypeError("retry_on must be an exception class or a tuple of them")
        self.fn = fn
        self.retries = retries
        self.retry_on = tuple(retry_on)
        self.name = clean_name(name if name is not None else str(getattr(fn, "__name__", "task")), "name")
        self.root = root
        self.run_name = run_name
        self.storage_options = storage_options

    def install(self) -> None:
        """Install the preemption handlers (a no-op off the main thread, and once installed)."""
        if self.preemption:
            preemption.install()

    def place(self, parent: TaskContext | None) -> _Place:
        """Where this call runs (root, run, action, options), decided where it was called: no storage I/O,
        and in call order (async calls: before their first ``await``), so that the action names of the same
        program are the same on every run. ``parent`` is the task in the caller's context variables."""
        if parent is None and self.root is None and active.busy():
            raise RuntimeError(
                f"task {self.name!r} was called in a thread that does not carry the context of the task that "
                "called it (a plain threading.Thread or ThreadPoolExecutor worker) while tasks run in this "
                "process: which task it belongs to, and so its action name and the checkpoint it resumes, "
                "would depend on thread timing. To run it as a subtask, start the thread with the caller's "
                "context (executor.submit(contextvars.copy_context().run, fn, ...), asyncio.to_thread or "
                "anyio.to_thread.run_sync) and give calls that run at the same time names of their own "
                "(taskpoint.task(name=f'shard-{i}')(fn)); to run it as a task of its own, give it root=.")
        if parent is not None and parent.root is not None and self.root is None:
            options = self.storage_options if self.storage_options is not None else parent.storage_options
            action = _action_for(parent.run_name, parent.action_name, f"{parent.action_name}.{self.name}")
            return _Place(parent.root, parent.run_name, action, options)
        root = self.root or default_root()
        run_name = clean_name(self.run_name or os.environ.get(ENV_RUN_NAME, "") or _new_run_name(self.name),
                              "run_name")
        options = self.storage_options if self.storage_options is not None else env_storage_options()
        return _Place(root, run_name, self.name, options)  # a top-level call with a known run name continues it

    def store(self, place: _Place) -> ActionStore:
        """The storage of the call's action (opens its filesystem), for this process's rank."""
        return ActionStore(place.root, place.run_name, place.action, place.options, self.checkpoints,
                           ranks_from_environment())

    def attempts(self, store: ActionStore) -> range:
        """The attempt numbers this call may use: after those in storage (a listing). With several ranks the
        first is started here, agreed by all ranks (:meth:`ActionStore.claim`)."""
        first = store.claim() if store.ranks.distributed else max(store.attempts(), default=0) + 1
        return range(first, first + self.retries + 1)

    def failed(self, exc: BaseException, attempt: int, last: int, context: TaskContext,
               cleanup: list[Exception]) -> bool:
        """Annotate ``exc`` (and log the failure); True when another attempt should follow."""
        if isinstance(exc, Preempted):  # not a failure, and not retried here: the process is being stopped
            add_note(exc, f"taskpoint: attempt {attempt} of task {context.action_name!r} (run "
                          f"{context.run_name!r}) was preempted; the next attempt resumes from its emergency save")
            _log.warning("taskpoint: attempt %d of task %r (run %r) was preempted: %s", attempt,
                         context.action_name, context.run_name, exc)
            return False
        retry = isinstance(exc, self.retry_on) and attempt < last
        what = (f"taskpoint: attempt {attempt} of {last} of task {context.action_name!r} "
                f"(run {context.run_name!r}) failed")
        add_note(exc, what + ("; retrying" if retry else ""))
        for error in cleanup:
            add_note(exc, f"taskpoint: ending attempt {attempt} also failed: {type(error).__name__}: {error}")
        # Notes are not printed before Python 3.11, and a retried attempt's exception is never raised: the
        # log says which attempt failed, with what, and what happens next, on every version.
        also = "".join(f"; ending it also failed: {type(error).__name__}: {error}" for error in cleanup)
        _log.warning("%s: %s: %s%s%s", what, type(exc).__name__, exc, also,
                     "; retrying" if retry else "; not retrying")
        return retry


class _Place(NamedTuple):
    root: str
    run_name: str
    action: str
    options: dict[str, Any] | None


class _Attempt:
    """One attempt. Its steps are split by where they run: :meth:`open` and :meth:`release` do storage I/O
    (a worker thread for async tasks), :meth:`enter` and :meth:`leave` set the context variable (the
    caller's thread or async task). As a context manager it runs them all, and on exit says whether to
    retry."""

    def __init__(self, spec: _TaskSpec, store: ActionStore, number: int, numbers: range,
                 parent: TaskContext | None) -> None:
        self._spec, self._store, self._number, self._numbers = spec, store, number, numbers
        self._parent = parent

    def open(self) -> TaskContext:
        """Write the attempt's marker and find the checkpoint it resumes (storage I/O). With several ranks, a
        retry is agreed again: all ranks retry together (a failed collective fails every rank)."""
        if self._store.ranks.distributed:
            self._store.claim(self._number)
        else:
            self._store.begin(self._number)
        context = self._store.context(self._number, len(self._numbers))
        context.preemption, context.save_on_preemption = self._spec.preemption, self._spec.save_on_preemption
        return context

    def enter(self, context: TaskContext) -> TaskContext:
        self._context = context
        self._token = set_context(context)
        active.push(context, self._parent)
        return context

    def leave(self) -> None:
        active.pop(self._context)
        reset_context(self._token)

    def release(self) -> list[Exception]:
        """Remove the attempt's workspace and close its manager (waiting for a background save); return what
        failed. A long-lived worker must not pile workspaces up."""
        errors: list[Exception] = []
        for close in (self._context.checkpoint, self._context._manager):
            if close is None:
                continue
            try:
                close.close()
            except Exception as exc:
                errors.append(exc)
        return errors

    def decide(self, exc: BaseException | None, cleanup: list[Exception]) -> bool:
        """True to start the next attempt. A failed attempt's cleanup errors become notes on its exception,
        and the retry is decided as if there were none. After an attempt that returned, a cleanup error (a
        background save that failed) is raised: the result is not returned, and the function is not run
        again."""
        if exc is not None:
            return self._spec.failed(exc, self._number, self._numbers[-1], self._context, cleanup)
        if not cleanup:
            return False
        error = cleanup[0]
        for other in cleanup[1:]:
            add_note(error, f"taskpoint: ending the attempt also failed: {type(other).__name__}: {other}")
        what = (f"taskpoint: attempt {self._number} of task {self._context.action_name!r} (run "
                f"{self._context.run_name!r}) returned, but ending it failed; its result is not returned and "
                "it is not run again")
        add_note(error, what)
        _log.warning("%s: %s: %s", what, type(error).__name__, error)
        raise error

    def __enter__(self) -> TaskContext:
        return self.enter(self.open())

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        self.leave()
        # True swallows the exception, and the caller's loop starts the next attempt.
        return self.decide(exc, self.release())


def _wrap(spec: _TaskSpec) -> Callable[..., Any]:
    fn = spec.fn
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            parent = current()
            spec.install()
            place = spec.place(parent)  # here, in call order: the action name must not depend on threads
            # Storage I/O runs in worker threads (as the checkpoint calls do): the event loop keeps running.
            store = await anyio.to_thread.run_sync(spec.store, place)
            numbers = await anyio.to_thread.run_sync(spec.attempts, store)
            for number in numbers:
                attempt = _Attempt(spec, store, number, numbers, parent)
                attempt.enter(await anyio.to_thread.run_sync(attempt.open))
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    attempt.leave()
                    with anyio.CancelScope(shield=True):  # a cancelled task still releases its attempt
                        cleanup = await anyio.to_thread.run_sync(attempt.release)
                    if attempt.decide(exc, cleanup):
                        continue
                    raise
                attempt.leave()
                with anyio.CancelScope(shield=True):
                    cleanup = await anyio.to_thread.run_sync(attempt.release)
                attempt.decide(None, cleanup)
                return result
            raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

        return run_async

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        parent = current()
        spec.install()
        store = spec.store(spec.place(parent))
        numbers = spec.attempts(store)
        for number in numbers:
            with _Attempt(spec, store, number, numbers, parent):
                return fn(*args, **kwargs)
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    return run


@overload
def task(fn: F, /) -> F: ...


@overload
def task(
    *, retries: int = 3, retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    name: str | None = None, root: str | None = None, run_name: str | None = None,
    storage_options: dict[str, Any] | None = None, checkpoints: dict[str, Any] | None = None,
    preemption: bool = True, save_on_preemption: Callable[[], Any] | None = None,
) -> Callable[[F], F]: ...


def task(
    fn: Callable[..., Any] | None = None, /, *, retries: int = 3,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    name: str | None = None, root: str | None = None, run_name: str | None = None,
    storage_options: dict[str, Any] | None = None, checkpoints: dict[str, Any] | None = None,
    preemption: bool = True, save_on_preemption: Callable[[], Any] | None = None,
) -> Any:
    """Make a function (plain or ``async def``) a task: each call runs it with retries and checkpoints.

    Each attempt gets a fresh :class:`TaskContext` (``taskpoint.ctx()``) whose ``checkpoint`` saves to this
    attempt's folder and loads from the newest earlier attempt that saved. An exception listed in
    ``retry_on`` starts the next attempt; after the last one the original exception propagates, with a
    note naming the attempt. Each failed attempt is also logged (logger ``taskpoint``, WARNING). Errors met
    while ending an attempt (a failed background save of ``ctx().checkpoints``) become notes on a failed
    attempt's exception and never stop the retries; after an attempt that returned, such an error is
    raised and the function is not run again. An ``async def`` task does its storage I/O in worker
    threads. Called from a plain thread (no copied context) while tasks run, a task without ``root=``
    raises RuntimeError: its parent, and so its action name, cannot be told.

    Args:
        retries: attempts after the first (``retries + 1`` in all, per call or per rerun of a run).
        retry_on: exception classes that start another attempt; others propagate at once.
        name: the action name (default: the function's name).
        root: where checkpoints live, any fsspec URL (default ``$TASKPOINT_ROOT`` or ``./.taskpoint``).
        run_name: names the run; calling again (or a restarted process) with the same name continues it.
            Default ``$TASKPOINT_RUN_NAME``, else a new name per call.
        storage_options: fsspec options for ``root`` (default ``$TASKPOINT_STORAGE_OPTIONS``, JSON).
        checkpoints: options of the versioned manager behind ``ctx().checkpoints`` (``keep``,
            ``keep_every``, ``codec``, ``async_save``, ...), as for :class:`CheckpointManager`.
        preemption: install the preemption handlers (``SIGTERM`` by default, from the main thread) and react
            to notices (``ctx().preempted``); False opts out.
        save_on_preemption: a function returning the state to save when a notice arrives. The next safe
            point (a save of ``ctx().checkpoints``, or ``ctx().checkpoint_if_preempted()``) saves it, waits
            for its commit and raises :class:`~taskpoint.Preempted`: the attempt ends without counting as a
            failure and is not retried in this process; the next attempt resumes from that save.
    """
    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"@task decorates functions, not {type(f).__name__}")
        return _wrap(_TaskSpec(f, retries, retry_on if isinstance(retry_on, tuple) else (retry_on,),
                               name, root, run_name, storage_options, checkpoints, preemption,
                               save_on_preemption))

    if fn is not None:
        return decorate(fn)
    return decorate
