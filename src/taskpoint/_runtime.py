"""Running tasks with retries: attempts, their storage layout, and the lineage that finds what to resume.

Layout under a root (any fsspec URL)::

    {root}/{run_name}/{action_name}/{attempt}/attempt.json   written when the attempt starts
    {root}/{run_name}/{action_name}/{attempt}/checkpoint     the attempt's checkpoint object (+ its record)
    {root}/{run_name}/{action_name}/steps/                   the versioned manager shared by all attempts

The source of attempt ``n`` is the newest earlier attempt of the same run and action that holds a
checkpoint, so an attempt that died before its first save never costs the progress before it.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

import fsspec

from ._checkpoint import Checkpoint
from ._context import TaskContext, _current, _reset_context, _set_context
from ._storage import Location
from .errors import add_note

F = TypeVar("F", bound=Callable[..., Any])

#: Name of the checkpoint object inside an attempt folder.
CHECKPOINT_NAME = "checkpoint"
#: Name of the marker written when an attempt starts (so numbering survives attempts that never saved).
ATTEMPT_MARKER = "attempt.json"
#: Folder of the versioned manager shared by all attempts of an action.
STEPS_FOLDER = "steps"
DEFAULT_ROOT = ".taskpoint"

ENV_ROOT = "TASKPOINT_ROOT"
ENV_RUN_NAME = "TASKPOINT_RUN_NAME"
ENV_ACTION_NAME = "TASKPOINT_ACTION_NAME"
ENV_ATTEMPT = "TASKPOINT_ATTEMPT"
ENV_CHECKPOINT_PATH = "TASKPOINT_CHECKPOINT_PATH"
ENV_PREV_CHECKPOINT = "TASKPOINT_PREV_CHECKPOINT"
ENV_STORAGE_OPTIONS = "TASKPOINT_STORAGE_OPTIONS"
#: Restart counters of orchestrators, each counting from 0 for the first run: attempt = counter + 1.
RESTART_COUNTERS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "FLYTE_ATTEMPT_NUMBER")

_NAME_OK = re.compile(r"[^A-Za-z0-9._-]+")


def _clean_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{what} must be a non-empty str, got {name!r}")
    cleaned = _NAME_OK.sub("-", name.strip()).strip("-.")
    if not cleaned:
        raise ValueError(f"{what} {name!r} has no usable characters (letters, digits, '.', '_', '-')")
    return cleaned


def default_root() -> str:
    """``$TASKPOINT_ROOT``, else ``.taskpoint`` in the working directory (as an absolute path)."""
    root = os.environ.get(ENV_ROOT, "").strip()
    return root if root else os.path.abspath(DEFAULT_ROOT)


def env_storage_options() -> dict[str, Any] | None:
    raw = os.environ.get(ENV_STORAGE_OPTIONS, "").strip()
    if not raw:
        return None
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"${ENV_STORAGE_OPTIONS} must be a JSON object: {exc}") from exc
    if not isinstance(options, dict):
        raise ValueError(f"${ENV_STORAGE_OPTIONS} must be a JSON object, got {type(options).__name__}")
    return options


class ActionStore:
    """The storage of one run and action: its attempt folders and what they hold."""

    def __init__(self, root: str, run_name: str, action_name: str, storage_options: dict[str, Any] | None,
                 manager_options: dict[str, Any] | None = None):
        self.manager_options = dict(manager_options or {})
        self.root = root.rstrip("/") if "://" in root else os.path.abspath(root)
        self.run_name = run_name
        self.action_name = action_name
        self.storage_options = storage_options
        self.prefix = f"{self.root}/{run_name}/{action_name}"
        self._fs, self._path = fsspec.core.url_to_fs(self.prefix, **(storage_options or {}))

    def attempt_uri(self, attempt: int) -> str:
        return f"{self.prefix}/{attempt}/{CHECKPOINT_NAME}"

    def steps_uri(self) -> str:
        return f"{self.prefix}/{STEPS_FOLDER}"

    def attempts(self) -> list[int]:
        """Attempt numbers that exist in storage (marker or checkpoint), ascending."""
        self._fs.invalidate_cache(self._path)
        try:
            names = self._fs.ls(self._path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = {int(base) for base in (n.rstrip("/").rsplit("/", 1)[-1] for n in names) if base.isdigit()}
        return sorted(n for n in found if n >= 1)

    def begin(self, attempt: int) -> None:
        marker = {"attempt": attempt, "started": time.time(), "pid": os.getpid(), "host": socket.gethostname()}
        Location(f"{self.prefix}/{attempt}/{ATTEMPT_MARKER}", self.storage_options).write_small(
            json.dumps(marker).encode(), action="start the attempt at")

    def resume_source(self, attempt: int) -> str | None:
        """The checkpoint of the newest earlier attempt that saved one; None when none did."""
        for earlier in sorted((n for n in self.attempts() if n < attempt), reverse=True):
            uri = self.attempt_uri(earlier)
            if Location(uri, self.storage_options).exists():
                return uri
        return None

    def context(self, attempt: int, max_attempts: int | None) -> TaskContext:
        checkpoint = Checkpoint(self.attempt_uri(attempt), self.resume_source(attempt),
                                storage_options=self.storage_options)
        return TaskContext(run_name=self.run_name, action_name=self.action_name, attempt=attempt,
                           max_attempts=max_attempts, checkpoint=checkpoint, root=self.root,
                           storage_options=self.storage_options, manager_options=self.manager_options)


# -- the decorator --------------------------------------------------------------------------------------

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
        self.name = _clean_name(name if name is not None else str(getattr(fn, "__name__", "task")), "name")
        self.root = root
        self.run_name = run_name
        self.storage_options = storage_options

    def store(self) -> ActionStore:
        parent = _current.get() or _active.only()  # a running task, not a context from the environment
        if parent is not None and parent.root is not None and self.root is None:
            root, run_name = parent.root, parent.run_name
            options = self.storage_options if self.storage_options is not None else parent.storage_options
            action = _action_for(run_name, parent.action_name, f"{parent.action_name}.{self.name}")
        else:
            root = self.root or default_root()
            run_name = _clean_name(self.run_name or os.environ.get(ENV_RUN_NAME, "") or _new_run_name(self.name),
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
    _active.pop(context)
    _reset_context(token)
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
        self._token = _set_context(self._context)
        _active.push(self._context)
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


# -- contexts visible from plain threads ------------------------------------------------------------------


class _ActiveContexts:
    """Contexts of tasks running in this process, for threads started without copying context variables."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stack: list[TaskContext] = []

    def push(self, context: TaskContext) -> None:
        with self._lock:
            self._stack.append(context)

    def pop(self, context: TaskContext) -> None:
        with self._lock:
            if context in self._stack:
                self._stack.remove(context)

    def only(self) -> TaskContext | None:
        """The innermost context when all running tasks form one chain (one root task); else None."""
        with self._lock:
            if not self._stack:
                return None
            runs = {c.run_name for c in self._stack}
            return self._stack[-1] if len(runs) == 1 else None


_active = _ActiveContexts()


# -- contexts from the environment (taskpoint run, orchestrators) ----------------------------------------

_ENV_KEYS = (ENV_ROOT, ENV_RUN_NAME, ENV_ACTION_NAME, ENV_ATTEMPT, ENV_CHECKPOINT_PATH, ENV_PREV_CHECKPOINT,
             ENV_STORAGE_OPTIONS, *RESTART_COUNTERS)
_env_lock = threading.RLock()
_env_building = False
_env_cache: tuple[tuple[str | None, ...], TaskContext | None] | None = None


def attempt_from_environment() -> int | None:
    """``$TASKPOINT_ATTEMPT`` (from 1), else an orchestrator's restart counter + 1, else None."""
    raw = os.environ.get(ENV_ATTEMPT, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"${ENV_ATTEMPT} must be an integer >= 1, got {raw!r}")
        return int(raw)
    for name in RESTART_COUNTERS:
        raw = os.environ.get(name, "").strip()
        if raw.isdigit():
            return int(raw) + 1
    return None


def environment_context() -> TaskContext | None:
    """The context described by ``TASKPOINT_*`` variables, built once per set of values; None if none."""
    global _env_cache, _env_building
    key = tuple(os.environ.get(k) for k in _ENV_KEYS)
    with _env_lock:
        if _env_building:  # ctx() asked while the context is being built (e.g. by the URI repair)
            return None
        if _env_cache is not None and _env_cache[0] == key:
            return _env_cache[1]
        _env_building = True
        try:
            context = _build_environment_context()
        finally:
            _env_building = False
        _env_cache = (key, context)
        return context


def _build_environment_context() -> TaskContext | None:
    from ._repair import repair_prev_checkpoint_uri

    options = env_storage_options()
    run_name = os.environ.get(ENV_RUN_NAME, "").strip() or None
    action_name = os.environ.get(ENV_ACTION_NAME, "").strip() or None
    dest = os.environ.get(ENV_CHECKPOINT_PATH, "").strip()
    if dest:
        attempt = attempt_from_environment()
        prev = repair_prev_checkpoint_uri(os.environ.get(ENV_PREV_CHECKPOINT), run_name=run_name,
                                          action_name=action_name, attempt=attempt)
        checkpoint = Checkpoint(dest, prev, storage_options=options)
        return TaskContext(run_name=run_name or "", action_name=action_name or "", attempt=attempt or 1,
                           max_attempts=None, checkpoint=checkpoint, storage_options=options)
    root = os.environ.get(ENV_ROOT, "").strip()
    if root and run_name and action_name:
        store = ActionStore(root, _clean_name(run_name, "run name"), _clean_name(action_name, "action"), options)
        attempt = attempt_from_environment() or max(store.attempts(), default=0) + 1
        store.begin(attempt)
        return store.context(attempt, None)
    return None
