"""The task decorator: each call runs the function with retries, each attempt in its own context."""

from __future__ import annotations

import functools
import inspect
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

from ..errors import add_note
from .layout import ENV_RUN_NAME, clean_name, default_root, env_storage_options
from .lineage import ActionStore
from .state import TaskContext, active, reset_context, running, set_context

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
                 storage_options: dict[str, Any] | None, checkpoints: dict[str, Any] | None = None) -> None:
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

    def store(self) -> ActionStore:
        parent = running()  # a running task, not a context from the environment
        if parent is not None and parent.root is not None and self.root is None:
            root, run_name = parent.root, parent.run_name
            options = self.storage_options if self.storage_options is not None else parent.storage_options
            action = _action_for(run_name, parent.action_name, f"{parent.action_name}.{self.name}")
        else:
            root = self.root or default_root()
            run_name = clean_name(self.run_name or os.environ.get(ENV_RUN_NAME, "") or _new_run_name(self.name),
                                   "run_name")
            options = self.storage_options if self.storage_options is not None else env_storage_options()
            action = self.name  # a top-level call with a known run name continues that run's action
        return ActionStore(root, run_name, action, options, self.checkpoints)

    def attempts(self, store: ActionStore) -> range:
        first = (max(store.attempts(), default=0)) + 1
        return range(first, first + self.retries + 1)

    def failed(self, exc: BaseException, attempt: int, last: int, context: TaskContext) -> bool:
        """Annotate ``exc``; True when another attempt should follow."""
        retry = isinstance(exc, self.retry_on) and attempt < last
        note = (f"taskpoint: attempt {attempt} of {last} of task {context.action_name!r} "
                f"(run {context.run_name!r}) failed" + ("; retrying" if retry else ""))
        add_note(exc, note)
        return retry


def _end_attempt(context: TaskContext, token: Any) -> None:
    """Leave the attempt's context and remove its workspace: a long-lived worker must not pile them up."""
    active.pop(context)
    reset_context(token)
    if context.checkpoint is not None:
        context.checkpoint.close()
    manager = context._manager
    if manager is not None:
        manager.close()


class _Attempt:
    """One attempt as a context manager: enters its context; on exit, ends it and says whether to retry."""

    def __init__(self, spec: _TaskSpec, store: ActionStore, number: int, numbers: range) -> None:
        self._spec, self._store, self._number, self._numbers = spec, store, number, numbers

    def __enter__(self) -> TaskContext:
        self._store.begin(self._number)
        self._context = self._store.context(self._number, len(self._numbers))
        self._token = set_context(self._context)
        active.push(self._context)
        return self._context

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        _end_attempt(self._context, self._token)
        # True swallows the exception, and the caller's loop starts the next attempt.
        return exc is not None and self._spec.failed(exc, self._number, self._numbers[-1], self._context)


def _attempts(spec: _TaskSpec) -> Iterator[_Attempt]:
    store = spec.store()
    numbers = spec.attempts(store)
    for number in numbers:
        yield _Attempt(spec, store, number, numbers)


def _wrap(spec: _TaskSpec) -> Callable[..., Any]:
    fn = spec.fn
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            for attempt in _attempts(spec):
                with attempt:
                    return await fn(*args, **kwargs)
            raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

        return run_async

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        for attempt in _attempts(spec):
            with attempt:
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
) -> Callable[[F], F]: ...


def task(
    fn: Callable[..., Any] | None = None, /, *, retries: int = 3,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    name: str | None = None, root: str | None = None, run_name: str | None = None,
    storage_options: dict[str, Any] | None = None, checkpoints: dict[str, Any] | None = None,
) -> Any:
    """Make a function (plain or ``async def``) a task: each call runs it with retries and checkpoints.

    Each attempt gets a fresh :class:`TaskContext` (``taskpoint.ctx()``) whose ``checkpoint`` saves to this
    attempt's folder and loads from the newest earlier attempt that saved. An exception listed in
    ``retry_on`` starts the next attempt; after the last one the original exception propagates, with a
    note naming the attempt.

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
    """
    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"@task decorates functions, not {type(f).__name__}")
        return _wrap(_TaskSpec(f, retries, retry_on if isinstance(retry_on, tuple) else (retry_on,),
                               name, root, run_name, storage_options, checkpoints))

    if fn is not None:
        return decorate(fn)
    return decorate
