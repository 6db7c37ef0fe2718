"""The task context: who is running (run, action, attempt) and where its checkpoints live."""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint
    from ._manager import CheckpointManager

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
    """

    run_name: str
    action_name: str
    attempt: int
    max_attempts: int | None
    checkpoint: Checkpoint | None = None
    root: str | None = None
    storage_options: dict[str, Any] | None = None
    #: Options for the manager behind :attr:`checkpoints` (``@task(checkpoints={...})``).
    manager_options: dict[str, Any] = field(default_factory=dict)
    _manager: CheckpointManager | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """A versioned manager shared by all attempts of this run and action (None without a root)."""
        if self.root is None:
            return None
        with self._lock:
            if self._manager is None:
                from ._manager import CheckpointManager
                from ._runtime import STEPS_FOLDER

                uri = f"{self.root}/{self.run_name}/{self.action_name}/{STEPS_FOLDER}"
                self._manager = CheckpointManager(uri, storage_options=self.storage_options,
                                                  **self.manager_options)
            return self._manager


def ctx() -> TaskContext | None:
    """The context of the task this code runs in, or ``None`` outside a task.

    Inside ``@taskpoint.task`` it is the attempt's context (also in asyncio and trio tasks and in threads
    started through ``contextvars``-aware helpers; a plain thread sees it while only one task runs in the
    process). Outside, a process started by ``taskpoint run`` or given the ``TASKPOINT_*`` environment
    variables gets a context built from them.
    """
    current = _current.get()
    if current is not None:
        return current
    from ._runtime import _active, environment_context

    return _active.only() or environment_context()


def _set_context(value: TaskContext | None) -> contextvars.Token[TaskContext | None]:
    return _current.set(value)


def _reset_context(token: contextvars.Token[TaskContext | None]) -> None:
    _current.reset(token)
