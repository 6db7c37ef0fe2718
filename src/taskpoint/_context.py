"""The task context: who is running (run, action, attempt) and where its checkpoints live."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint

_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar("taskpoint_ctx", default=None)


@dataclass
class TaskContext:
    """What a running task knows about itself; returned by :func:`taskpoint.ctx`."""

    run_name: str
    action_name: str
    attempt: int
    max_attempts: int | None
    checkpoint: Checkpoint | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def ctx() -> TaskContext | None:
    """The context of the task this code runs in, or ``None`` outside a task."""
    return _current.get()


def _set_context(value: TaskContext | None) -> contextvars.Token[TaskContext | None]:
    return _current.set(value)


def _reset_context(token: contextvars.Token[TaskContext | None]) -> None:
    _current.reset(token)
