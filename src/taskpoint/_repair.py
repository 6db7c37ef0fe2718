"""Repair a previous-checkpoint URI that an orchestrator pointed at the *current* attempt."""

from __future__ import annotations

import os
import re

from ._context import ctx

# Object stores for which Flyte's executor has been seen to pass the current attempt's folder.
REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})
ATTEMPT_ENV = "FLYTE_ATTEMPT_NUMBER"
_QUOTES = "\"'"


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
    if prev_uri is None:
        return None
    uri = prev_uri.strip().strip(_QUOTES).strip()
    if not uri:
        return None
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme.lower() not in REMOTE_SCHEMES:
        return uri

    context = ctx()
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
    current = _current_attempt(attempt)
    if current is not None and current >= 1 and n not in (current, current + 1):
        return uri
    start, end = folder.span(1)
    return f"{uri[:start]}{n - 1}{uri[end:]}"


def _current_attempt(attempt: int | None) -> int | None:
    """The attempt number from the argument, the environment, or the task context; ``None`` if unknown."""
    if attempt is not None:
        return attempt
    try:
        return int(os.environ[ATTEMPT_ENV])
    except (KeyError, ValueError):
        pass
    context = ctx()
    return context.attempt if context is not None else None
