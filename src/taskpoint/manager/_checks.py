"""Checks of the manager's arguments: each returns the value to use or raises a TypeError or ValueError."""

from __future__ import annotations

import json
import math
import operator
from typing import Any

from ..storage import normalize_uri


def positive_or_none(value: int | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def check_grace(seconds: Any) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"grace_seconds must be a number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError("step must be an int, not bool")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, not {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def check_metadata(metadata: Any) -> dict[str, Any]:
    """A private copy of ``metadata`` after checking that JSON gives it back exactly as passed. Floats may be
    NaN or infinite (a diverged run's loss): Python's JSON writes and reads them as ``NaN`` and ``Infinity``."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values, not {type(metadata).__name__}")
    try:
        copy = json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must hold only JSON values (dict, list, str, int, float, bool, None): {exc}. "
                        "Convert numpy numbers, paths or datetimes first; nothing was saved.") from exc
    if not same_json(copy, metadata):
        raise TypeError("metadata would not come back as passed: use str keys and lists rather than tuples; "
                        "nothing was saved.")
    return copy  # type: ignore[no-any-return]


def same_json(a: Any, b: Any) -> bool:
    """``a == b`` for JSON values, where NaN equals NaN and a bool never equals a number."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def check_directory(directory: Any) -> str:
    """The manager's directory as a URI: a path or URI, without a trailing slash (a bare ``scheme://`` kept)."""
    uri = normalize_uri(directory, "directory").strip()
    if not uri:
        raise ValueError("directory must be a URI or path, got an empty string")
    return uri if uri.endswith("://") else uri.rstrip("/") or "/"
