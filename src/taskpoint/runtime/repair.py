"""The rules that repair a previous-checkpoint URI an orchestrator pointed at the *current* attempt.

:func:`repair_uri` takes everything it needs as arguments, so that building a context from the environment
can use it; :func:`taskpoint.repair_prev_checkpoint_uri` (in :mod:`.context`) fills the defaults from
:func:`taskpoint.ctx` and documents the rules.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from .state import TaskContext

# Object stores for which Flyte's executor has been seen to pass the current attempt's folder.
REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})
ATTEMPT_ENV = "FLYTE_ATTEMPT_NUMBER"
_QUOTES = "\"'"


def repair_uri(prev_uri: str | None, *, run_name: str | None, action_name: str | None, attempt: int | None,
               lookup: Callable[[], TaskContext | None]) -> str | None:
    """``prev_uri`` repaired by the rules of :func:`taskpoint.repair_prev_checkpoint_uri`; ``lookup`` gives the
    context that stands in for what is not given (asked only for a remote URI, as late as possible)."""
    if prev_uri is None:
        return None
    uri = prev_uri.strip().strip(_QUOTES).strip()
    if not uri:
        return None
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme.lower() not in REMOTE_SCHEMES:
        return uri

    context = lookup()
    if run_name is None and context is not None:
        run_name = context.run_name
    if action_name is None and context is not None:
        action_name = context.action_name
    if not run_name or not action_name:
        return uri

    folder = re.search(rf"/{re.escape(run_name)}/{re.escape(action_name)}/(\d+)(?=/|$)", uri)
    if folder is None:
        return uri
    n = int(folder.group(1))
    if n <= 1:
        return uri
    current = _current_attempt(attempt, lookup)
    if current is not None and current >= 1 and n not in (current, current + 1):
        return uri
    start, end = folder.span(1)
    return f"{uri[:start]}{n - 1}{uri[end:]}"


def _current_attempt(attempt: int | None, lookup: Callable[[], TaskContext | None]) -> int | None:
    """The attempt number from the argument, the environment, or the task context; ``None`` if unknown."""
    if attempt is not None:
        return attempt
    try:
        return int(os.environ[ATTEMPT_ENV])
    except (KeyError, ValueError):
        pass
    context = lookup()
    return context.attempt if context is not None else None
