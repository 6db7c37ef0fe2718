"""Finding the running task's context: :func:`ctx`, contexts built from the environment (``taskpoint run``,
orchestrators), and :func:`repair_prev_checkpoint_uri`, whose defaults come from them."""

from __future__ import annotations

import os
import threading

from .. import preemption
from ..checkpoint import Checkpoint
from ..ranks import RANK_VARIABLES, ranks_from_environment
from .flyte_bridge import flyte_context
from .layout import (
    ENV_ACTION_NAME,
    ENV_ATTEMPT,
    ENV_CHECKPOINT_PATH,
    ENV_PREV_CHECKPOINT,
    ENV_ROOT,
    ENV_RUN_NAME,
    ENV_STORAGE_OPTIONS,
    RESTART_COUNTERS,
    attempt_from_environment,
    clean_name,
    env_root,
    env_storage_options,
    rank_object,
)
from .lineage import ActionStore
from .repair import repair_uri
from .state import TaskContext, running


def ctx() -> TaskContext | None:
    """The context of the task this code runs in, or ``None`` outside a task.

    Inside ``@taskpoint.task`` it is the attempt's context (also in asyncio and trio tasks and in threads
    started through ``contextvars``-aware helpers; a plain thread sees it while only one task runs in the
    process). Outside, a process started by ``taskpoint run`` or given the ``TASKPOINT_*`` environment
    variables gets a context built from them; else, inside a Flyte 2 task, one on the checkpoint locations
    Flyte gives the attempt (``flyte.ctx().checkpoint``; flyte is never imported, only consulted once the
    program has imported it).
    """
    return running() or environment_context() or flyte_context()


def repair_prev_checkpoint_uri(
    prev_uri: str | None,
    *,
    run_name: str | None = None,
    action_name: str | None = None,
    attempt: int | None = None,
) -> str | None:
    """Return ``prev_uri`` cleaned up, with its attempt folder moved back one if it names the current one.

    Flyte's executor can hand a retry the previous-checkpoint URI ``.../{run}/{action}/{n}/...`` of the
    *current* attempt ``n`` instead of ``n - 1``, which holds nothing: the task would restart from zero.
    Rules, in order:

    - ``None``, or a string empty after stripping whitespace and quotes, gives ``None``.
    - Only ``s3``, ``s3a``, ``gs``, ``gcs``, ``abfs``, ``abfss`` and ``az`` URIs are rewritten (scheme
      compared case-insensitively); local paths and other schemes (``file://``, ``memory://``) come back
      stripped but unchanged.
    - ``run_name`` and ``action_name`` default to those of :func:`taskpoint.ctx`, each on its own. If either
      stays unknown or empty, nothing is rewritten: without them the attempt folder cannot be told apart
      from any other number in the path.
    - The first ``/{run}/{action}/{n}/`` in the URI (or ``/{run}/{action}/{n}`` ending it) is the attempt
      folder; with ``n <= 1`` there is no earlier attempt and nothing is rewritten.
    - The current attempt ``A`` is ``attempt``, else ``$FLYTE_ATTEMPT_NUMBER`` (ignored unless an integer),
      else the context's. When ``A >= 1``, ``n`` must equal ``A`` or ``A + 1`` (the folder may count from 1
      while ``A`` counts from 0); any other ``n`` is taken to be a correct previous URI. When ``A`` is unknown
      or below 1, ``n > 1`` suffices.
    - Then ``n`` becomes ``n - 1``.

    Differences from Flyte's ``repair_union_prev_checkpoint_uri`` (flyte-sdk ``src/flyte/_checkpoint.py``):
    ``abfs`` is remote here too; the scheme is case-insensitive; a URI ending in the attempt folder without
    a trailing ``/`` is repaired; single quotes are stripped as well as double ones; ``attempt`` and the
    context stand in when the environment variable is unset, and a malformed variable is ignored rather
    than raising; a given ``run_name`` is kept when only ``action_name`` comes from the context.
    """
    return repair_uri(prev_uri, run_name=run_name, action_name=action_name, attempt=attempt, lookup=ctx)


def running_attempt() -> int | None:
    """The attempt of the running task (:func:`ctx`'s), None outside one: what the manager records with each
    step (``taskpoint/__init__.py`` installs it there)."""
    context = ctx()
    return context.attempt if context is not None else None


_ENV_KEYS = (ENV_ROOT, ENV_RUN_NAME, ENV_ACTION_NAME, ENV_ATTEMPT, ENV_CHECKPOINT_PATH, ENV_PREV_CHECKPOINT,
             ENV_STORAGE_OPTIONS, *RESTART_COUNTERS, *RANK_VARIABLES)
_env_lock = threading.RLock()
_env_building = False
_env_cache: tuple[tuple[str | None, ...], TaskContext | None] | None = None


def environment_context() -> TaskContext | None:
    """The context described by ``TASKPOINT_*`` variables, built once per set of values; None if none."""
    global _env_cache, _env_building
    key = tuple(os.environ.get(k) for k in _ENV_KEYS)
    with _env_lock:
        if _env_building:  # ctx() asked again, in this thread, while the context is being built
            return None
        if _env_cache is not None and _env_cache[0] == key:
            return _env_cache[1]
        _env_building = True
        try:
            context = _build_environment_context()
        finally:
            _env_building = False
        if context is not None:
            preemption.install()  # as a task does (from the main thread): ctx().preempted works under `taskpoint run`
        _env_cache = (key, context)
        return context


def _build_environment_context() -> TaskContext | None:
    """With several ranks, each rank's checkpoint is ``{path}/rank-{k}``; in root mode without an attempt
    number, rank 0 chooses the next free one and the others agree on it (:mod:`.rendezvous`)."""
    options = env_storage_options()
    run_name = os.environ.get(ENV_RUN_NAME, "").strip() or None
    action_name = os.environ.get(ENV_ACTION_NAME, "").strip() or None
    dest = os.environ.get(ENV_CHECKPOINT_PATH, "").strip()
    ranks = ranks_from_environment()
    if dest:
        attempt = attempt_from_environment()
        # What ctx() would give here is this very context, still being built: there is none to consult.
        prev = repair_uri(os.environ.get(ENV_PREV_CHECKPOINT), run_name=run_name, action_name=action_name,
                          attempt=attempt, lookup=lambda: None)
        checkpoint = Checkpoint(rank_object(dest, ranks), None if prev is None else rank_object(prev, ranks),
                                storage_options=options)
        return TaskContext(run_name=run_name or "", action_name=action_name or "", attempt=attempt or 1,
                           max_attempts=None, checkpoint=checkpoint, storage_options=options, rank=ranks.rank,
                           world_size=ranks.world_size, local_rank=ranks.local_rank)
    root = env_root()
    if root and run_name and action_name:
        store = ActionStore(root, clean_name(run_name, "run name"), clean_name(action_name, "action"), options,
                            ranks=ranks)
        attempt = attempt_from_environment()  # the orchestrator's number: every rank reads the same
        if attempt is None:
            attempt = store.claim()
        else:
            store.begin(attempt)
        return store.context(attempt, None)
    return None
