"""Names that the runtime's storage layout and environment use, and how they are read.

Layout under a root (any fsspec URL)::

    {root}/{run_name}/{action_name}/{attempt}/attempt.json   written when the attempt starts
    {root}/{run_name}/{action_name}/{attempt}/checkpoint     the attempt's checkpoint object (+ its record)
    {root}/{run_name}/{action_name}/{attempt}/checkpoint/rank-{k}   with several ranks: rank k's checkpoint
    {root}/{run_name}/{action_name}/rendezvous/              where the ranks of a launch agree on the attempt
    {root}/{run_name}/{action_name}/steps/                   the versioned manager shared by all attempts
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ..ranks import Ranks
from ..storage.uris import check_uri

#: Name of the checkpoint object inside an attempt folder.
CHECKPOINT_NAME = "checkpoint"
#: Name of the marker written when an attempt starts (so numbering survives attempts that never saved).
ATTEMPT_MARKER = "attempt.json"
#: Folder of the versioned manager shared by all attempts of an action.
STEPS_FOLDER = "steps"
DEFAULT_ROOT = ".taskpoint"
#: Folder, beside the attempts, where the ranks of one launch agree on their attempt.
RENDEZVOUS_FOLDER = "rendezvous"
#: How long ranks wait for each other to agree on the attempt, unless ``$TASKPOINT_RENDEZVOUS_TIMEOUT`` says.
RENDEZVOUS_TIMEOUT = 600.0

ENV_ROOT = "TASKPOINT_ROOT"
ENV_RUN_NAME = "TASKPOINT_RUN_NAME"
ENV_ACTION_NAME = "TASKPOINT_ACTION_NAME"
ENV_ATTEMPT = "TASKPOINT_ATTEMPT"
ENV_CHECKPOINT_PATH = "TASKPOINT_CHECKPOINT_PATH"
ENV_PREV_CHECKPOINT = "TASKPOINT_PREV_CHECKPOINT"
ENV_STORAGE_OPTIONS = "TASKPOINT_STORAGE_OPTIONS"
ENV_RENDEZVOUS_TIMEOUT = "TASKPOINT_RENDEZVOUS_TIMEOUT"
#: Restart counters of orchestrators, each counting from 0 for the first run: attempt = counter + 1.
RESTART_COUNTERS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "FLYTE_ATTEMPT_NUMBER")

_NAME_OK = re.compile(r"[^A-Za-z0-9._-]+")


def clean_name(name: str, what: str) -> str:
    """``name`` made safe as one path segment (runs of other characters become ``-``)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{what} must be a non-empty str, got {name!r}")
    cleaned = _NAME_OK.sub("-", name.strip()).strip("-.")
    if not cleaned:
        raise ValueError(f"{what} {name!r} has no usable characters (letters, digits, '.', '_', '-')")
    return cleaned


def env_root() -> str:
    """``$TASKPOINT_ROOT`` ("" when unset); ValueError when it looks like a URL and is not one (``s3:/b/x``),
    rather than a root in a local folder named after it."""
    root = os.environ.get(ENV_ROOT, "").strip()
    if root:
        check_uri(root, f"${ENV_ROOT}")
    return root


def default_root() -> str:
    """``$TASKPOINT_ROOT``, else ``.taskpoint`` in the working directory (as an absolute path)."""
    return env_root() or os.path.abspath(DEFAULT_ROOT)


def env_storage_options() -> dict[str, Any] | None:
    """``$TASKPOINT_STORAGE_OPTIONS`` as a dict (JSON object); None when unset."""
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


def rank_object(uri: str, ranks: Ranks) -> str:
    """``uri`` for one rank; with several ranks, ``{uri}/rank-{k}`` (each rank its own checkpoint)."""
    return f"{uri.rstrip('/')}/rank-{ranks.rank}" if ranks.distributed else uri


def rendezvous_timeout() -> float:
    """``$TASKPOINT_RENDEZVOUS_TIMEOUT`` (seconds > 0), else :data:`RENDEZVOUS_TIMEOUT`."""
    raw = os.environ.get(ENV_RENDEZVOUS_TIMEOUT, "").strip()
    if not raw:
        return RENDEZVOUS_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"${ENV_RENDEZVOUS_TIMEOUT} must be a number of seconds > 0, got {raw!r}")
    return value
