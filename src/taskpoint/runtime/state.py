"""The task context as a value, and where the running one is kept: who is running (run, action, attempt) and
where its checkpoints live. Imports nothing of the runtime but its layout names."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import preemption as _preemption
from ..checkpoint import Checkpoint
from ..errors import Preempted
from ..manager import CheckpointManager
from .layout import STEPS_FOLDER

_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar("taskpoint_ctx", default=None)


@dataclass(eq=False)
class TaskContext:
    """What a running task knows about itself; returned by :func:`taskpoint.ctx`.

    Attributes:
        run_name: the run this attempt belongs to.
        action_name: the task (action) within the run.
        attempt: 1 for the first try.
        max_attempts: attempts this call may make (None when an orchestrator decides).
        checkpoint: saves to this attempt's location, loads the previous attempt's; None when the runtime
            has no checkpoint locations.
        root: the storage root of the run (None when the locations came from an orchestrator).
        storage_options: fsspec options for the locations.
        preemption: whether this task reacts to preemption notices (``@task(preemption=...)``).
        save_on_preemption: the function returning the state of the emergency save
            (``@task(save_on_preemption=...)``), or None.
        rank, world_size, local_rank: this process's place in a job of several ranks (torchrun's, Slurm's or
            ``TASKPOINT_*`` variables; 0, 1, 0 otherwise). With several ranks, :attr:`checkpoint` saves and
            loads this rank's own checkpoint, and :attr:`checkpoints` saves this rank's shard of each step.
    """

    run_name: str
    action_name: str
    attempt: int
    max_attempts: int | None
    checkpoint: Checkpoint | None = None
    root: str | None = None
    #: Not in the repr: options hold credentials, and reprs end up in logs and error reports.
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    #: Options for the manager behind :attr:`checkpoints` (``@task(checkpoints={...})``).
    manager_options: dict[str, Any] = field(default_factory=dict)
    preemption: bool = True
    save_on_preemption: Callable[[], Any] | None = field(default=None, repr=False)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    _manager: CheckpointManager | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """A versioned manager shared by all attempts of this run and action (None without a root)."""
        if self.root is None:
            return None
        with self._lock:
            if self._manager is None:
                uri = f"{self.root}/{self.run_name}/{self.action_name}/{STEPS_FOLDER}"
                options = {"preemption": self.preemption, "on_preemption": self.save_on_preemption,
                           "rank": self.rank, "world_size": self.world_size, **self.manager_options}
                self._manager = CheckpointManager(uri, storage_options=self.storage_options, **options)
            return self._manager

    @property
    def preempted(self) -> _preemption.Notice | None:
        """The preemption notice (``signal``, ``at``, ``deadline``) once one arrived, else None."""
        return _preemption.notice() if self.preemption else None

    def checkpoint_if_preempted(self, state: Callable[[], Any] | None = None) -> None:
        """A safe point: one line in a training loop. Without a notice it returns at once. With one, it saves
        the state ``state()`` (default: the task's ``save_on_preemption``; a context built from the
        environment by ``taskpoint run`` has none) returns (after finishing a save in flight) and raises
        :class:`~taskpoint.Preempted` once that save committed: as the next step of :attr:`checkpoints` when
        this attempt used the manager, else as :attr:`checkpoint`. The next attempt resumes from it."""
        notice = self.preempted
        if notice is None:
            return
        fn = state or self.save_on_preemption
        if fn is None:
            raise TypeError("ctx().checkpoint_if_preempted() needs the state to save: give the task "
                            "save_on_preemption=fn, or pass the function: checkpoint_if_preempted(fn)")
        with self._lock:
            manager = self._manager
        if manager is not None:
            manager.checkpoint_if_preempted(fn)
        if self.checkpoint is None:
            raise Preempted(notice.signal)  # nowhere to save: the attempt still ends at this safe point
        with _preemption.emergency():
            self.checkpoint.save_sync(fn())
        where = self.checkpoint.remote_destination
        _preemption.ending("taskpoint: %s: the emergency save committed the task's checkpoint at %s; ending the "
                           "process with status %d", notice.name, where, 128 + notice.signal)
        raise Preempted(notice.signal, None, where, time.time())


def set_context(value: TaskContext | None) -> contextvars.Token[TaskContext | None]:
    return _current.set(value)


def reset_context(token: contextvars.Token[TaskContext | None]) -> None:
    _current.reset(token)


class ActiveContexts:
    """Contexts of tasks running in this process, for threads started without copying context variables.

    Each is kept with its parent (the task whose context variable it was called in, or None), so that a
    plain thread is given a context only when the running tasks form one chain of nested calls: with two
    sibling subtasks running, a plain thread could belong to either, and it gets none.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stack: list[tuple[TaskContext, TaskContext | None]] = []

    def push(self, context: TaskContext, parent: TaskContext | None = None) -> None:
        with self._lock:
            self._stack.append((context, parent))

    def pop(self, context: TaskContext) -> None:
        with self._lock:
            self._stack = [entry for entry in self._stack if entry[0] is not context]

    def busy(self) -> bool:
        """True while any task runs in this process."""
        with self._lock:
            return bool(self._stack)

    def only(self) -> TaskContext | None:
        """The innermost context when the running tasks form one chain, each called inside the one before
        (one root task, no siblings); else None."""
        with self._lock:
            if not self._stack:
                return None
            outer: TaskContext | None = None
            for context, parent in self._stack:
                if parent is not outer:
                    return None
                outer = context
            return outer


active = ActiveContexts()


def current() -> TaskContext | None:
    """The context in this thread's or async task's context variables; None outside a task and in threads
    started without copying them."""
    return _current.get()


def running() -> TaskContext | None:
    """The context of the task running here (this context, or the only chain of tasks in the process);
    None outside a task. Unlike :func:`taskpoint.ctx`, never builds a context from the environment."""
    return _current.get() or active.only()
