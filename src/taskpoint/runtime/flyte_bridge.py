"""Attaching to Flyte 2: inside a Flyte task, :func:`taskpoint.ctx` is built from ``flyte.ctx()``.

The checkpoint is a taskpoint :class:`~taskpoint.Checkpoint` on the destination and source Flyte gives the
attempt (``flyte.ctx().checkpoint``), so what one side saves the other loads; the attempt is Flyte's
``attempt_number`` + 1. flyte is never imported here: it is consulted only when the program already imported
it (a Flyte task always has), so programs without Flyte pay one dictionary lookup.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from ..checkpoint import Checkpoint
from ..ranks import ranks_from_environment
from .layout import env_storage_options, rank_object
from .state import TaskContext

#: Flyte's mode for ``flyte.run`` on this machine, where a retry's source is a copy of the destination.
FLYTE_LOCAL_MODE = "local"

#: One context per attempt, keyed by the attempt's ``flyte.Checkpoint`` (Flyte makes one per attempt and keeps
#: it for the attempt): every ``ctx()`` of an attempt sees the same checkpoint, and what it loaded.
_contexts: weakref.WeakKeyDictionary[Any, TaskContext] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def flyte_context() -> TaskContext | None:
    """The context of the Flyte task running here, or None: flyte not imported, outside a Flyte task, or a
    task without checkpoint locations."""
    flyte_ctx = getattr(sys.modules.get("flyte"), "ctx", None)  # None also while flyte is still being imported
    if flyte_ctx is None:
        return None
    task = flyte_ctx()
    if not task:  # outside a task flyte.ctx() is a falsy null context
        return None
    flyte_checkpoint = task.checkpoint
    if flyte_checkpoint is None:
        return None
    with _lock:
        context = _contexts.get(flyte_checkpoint)
        if context is None:
            context = _build(task, flyte_checkpoint)
            _contexts[flyte_checkpoint] = context
            if context.checkpoint is not None:
                # The workspace goes when Flyte drops the attempt's checkpoint, not at interpreter exit.
                weakref.finalize(flyte_checkpoint, context.checkpoint.close)
        return context


def _build(task: Any, flyte_checkpoint: Any) -> TaskContext:
    """Locally, Flyte copies only the checkpoint object from the destination to the next attempt's source,
    not the record beside it: the source is verified against the destination's record (``copy_of``)."""
    options = env_storage_options()
    ranks = ranks_from_environment()
    dest = str(flyte_checkpoint.remote_destination)
    source = flyte_checkpoint.remote_source
    local = getattr(task, "mode", None) == FLYTE_LOCAL_MODE
    checkpoint = Checkpoint(rank_object(dest, ranks), None if source is None else rank_object(str(source), ranks),
                            storage_options=options, copy_of=rank_object(dest, ranks) if local else None)
    action = task.action
    return TaskContext(run_name=str(action.run_name or action.name), action_name=str(action.name),
                       attempt=int(task.attempt_number) + 1, max_attempts=None, checkpoint=checkpoint,
                       storage_options=options, rank=ranks.rank, world_size=ranks.world_size,
                       local_rank=ranks.local_rank)
