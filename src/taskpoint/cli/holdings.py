"""What a URI holds, read with the library's own code: a checkpoint object, a manager directory (and its local
tier), a task root or a folder of checkpoint objects, each as the plain dict that ``ls``, ``show``, ``verify``
and ``pull`` print or act on; and the location and step a URI names. Reading only: printing is the commands'.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import Checkpoint, checkpoints_in
from ..manager import MANIFEST_NAME, STEP_FOLDER, CheckpointManager
from ..runtime import layout
from ..storage import Location
from ._app import ERROR, _Failed, _Missing, _state


def _location(uri: str) -> Location:
    return Location(uri.rstrip("/") if not uri.endswith("://") else uri, _state().storage_options())


def target(uri: str, step: int | None) -> tuple[Location, int | None]:
    """The location and the step that ``uri`` (and ``--step``) name. A step's folder (``ckpts/ckpt-180``, the URI
    ``show`` and ``ls --json`` print for a step) is its manager directory and that step, so that every URI the
    command line prints is one it takes; anything else is itself, with ``step``."""
    loc = _location(uri)
    directory, _, name = loc.uri.rpartition("/")
    named = STEP_FOLDER.fullmatch(name)
    if named is None or loc.child(MANIFEST_NAME).read_small() is None:
        return loc, step
    if step is not None and step != int(named.group(1)):
        raise _Failed(ERROR, f"{uri} is step {named.group(1)} of {directory or '.'}, and --step says {step}: "
                             "give one or the other")
    return _location(directory or "."), int(named.group(1))


def _local_dir(path: str) -> Location:
    """The location of ``--local-dir``: a local path, so the storage options (the remote tier's) are not its."""
    return Location(path.rstrip("/") or path, {})


def _checkpoint(loc: Location) -> Checkpoint:
    return Checkpoint(loc.uri, storage_options=loc.storage_options)


def _checkpoint_view(loc: Location) -> dict[str, Any] | None:
    """A checkpoint object and its record (``<uri>.taskpoint.json``); None when neither is there."""
    try:
        with _checkpoint(loc) as checkpoint:
            described = checkpoint.describe()
    except FileNotFoundError:
        return None
    return {"type": "checkpoint", "uri": described.uri, "state": described.state, "size": described.size,
            "kind": described.kind, "created": described.created, "objects": list(described.objects),
            "record": described.record}


def _manager_view(loc: Location, metric: str | None = None) -> dict[str, Any] | None:
    """The steps of a CheckpointManager directory (with the value of ``metric`` in each step's metadata, when
    named); None when it holds no ``ckpt-N`` folder."""
    with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
        summaries = manager.inventory()
    if not summaries:
        return None
    rows = []
    for summary in summaries:
        row: dict[str, Any] = {"step": summary.step, "uri": summary.uri, "state": summary.state,
                               "size": summary.size, "created": summary.created, "attempt": summary.attempt,
                               "kind": summary.kind, "leftovers": summary.leftovers,
                               "restore_leases": summary.restore_leases,
                               "metadata_keys": sorted(summary.metadata or {}), **summary.extras}
        if metric is not None and summary.metadata is not None:
            row["metric"] = summary.metadata.get(metric)
        if summary.problem is not None:
            row["problem"] = summary.problem
        rows.append(row)
    return {"type": "manager", "uri": loc.uri, "steps": rows}


def _task_root_view(loc: Location) -> dict[str, Any] | None:
    """Runs, actions and attempts under a task root (or a run's or an action's folder); None when none."""
    root = loc.path.rstrip("/")
    actions: dict[str, dict[str, Any]] = {}
    for path, info in loc.list_tree().items():
        parts = path[len(root) + 1:].split("/") if path.startswith(root + "/") else []
        if info.get("type") == "directory" or len(parts) < 2:
            continue
        if parts[-1] in (layout.ATTEMPT_MARKER, layout.CHECKPOINT_NAME) and parts[-2].isdigit():
            prefix, attempt = "/".join(parts[:-2]), int(parts[-2])
            entry = actions.setdefault(prefix, {"attempts": {}, "steps": []})
            slot = entry["attempts"].setdefault(attempt, {"attempt": attempt, "checkpoint_size": None})
            if parts[-1] == layout.CHECKPOINT_NAME:
                slot["checkpoint_size"] = int(info.get("size") or 0)
        elif (len(parts) >= 3 and parts[-1] == MANIFEST_NAME and parts[-3] == layout.STEPS_FOLDER
              and STEP_FOLDER.fullmatch(parts[-2])):
            prefix = "/".join(parts[:-3])
            entry = actions.setdefault(prefix, {"attempts": {}, "steps": []})
            entry["steps"].append(int(parts[-2][len("ckpt-"):]))
    if not actions:
        return None
    rows = []
    for prefix, entry in sorted(actions.items()):
        names = prefix.split("/") if prefix else []
        rows.append({"path": prefix, "run": names[0] if len(names) >= 2 else None,
                     "action": "/".join(names[1:]) if len(names) >= 2 else (names[0] if names else None),
                     "attempts": [entry["attempts"][n] for n in sorted(entry["attempts"])],
                     "steps": sorted(entry["steps"])})
    return {"type": "task-root", "uri": loc.uri, "actions": rows}


def folder_objects(loc: Location) -> list[Location]:
    """The checkpoint objects directly in the folder ``loc`` (:func:`taskpoint.checkpoints_in`)."""
    return [Location(uri, loc.storage_options) for uri in checkpoints_in(loc.uri, storage_options=loc.storage_options)]


def _folder_view(loc: Location) -> dict[str, Any] | None:
    """A folder of checkpoint objects (:func:`folder_objects`), each with what ``ls`` shows of one object; None
    when it holds none."""
    views = [view for view in map(_checkpoint_view, folder_objects(loc)) if view is not None]
    if not views:
        return None
    return {"type": "folder", "uri": loc.uri, "checkpoints": views}


def _what(loc: Location, metric: str | None = None) -> dict[str, Any]:
    """What the URI holds: a checkpoint object, a manager directory (each step's ``metric`` too, when named), a
    task root or a folder of checkpoint objects; _Missing otherwise."""
    view = _checkpoint_view(loc) or _manager_view(loc, metric) or _task_root_view(loc) or _folder_view(loc)
    if view is None:
        if loc.container_missing():
            raise _Failed(ERROR, f"{loc.uri}: the bucket or container does not exist. Create it, or fix the URI.")
        raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
    return view


def _tiers_view(uri: str, local_dir: str, metric: str | None) -> dict[str, Any]:
    """The steps of a manager directory and of its local tier, each row with its ``tier`` (``local`` first for
    a step on both); _Missing when neither holds a step."""
    remote_loc, local_loc = _location(uri), _local_dir(local_dir)
    views = {"remote": _manager_view(remote_loc, metric), "local": _manager_view(local_loc, metric)}
    if views["remote"] is None and views["local"] is None:
        raise _Missing(f"nothing taskpoint saved is at {remote_loc.uri} or {local_loc.uri}")
    rows = [{**row, "tier": tier} for tier, view in views.items() if view is not None for row in view["steps"]]
    rows.sort(key=lambda row: (row["step"], row["tier"] != "local"))
    committed = {tier: {row["step"] for row in rows if row["tier"] == tier and row["state"] == "committed"}
                 for tier in views}
    with _tier_managers(remote_loc, local_loc) as managers:
        stale = stale_copies(managers, committed["local"] & committed["remote"])
    for row in rows:
        if row["tier"] == "local":
            row["not_the_committed_step"] = stale.get(row["step"])
    return {"type": "manager", "uri": remote_loc.uri, "local_dir": local_loc.uri, "steps": rows}


@contextmanager
def _tier_managers(remote: Location, local: Location) -> Iterator[dict[str, CheckpointManager]]:
    """The managers of a manager directory (``remote``) and of its local tier, by tier, open for the block."""
    with CheckpointManager(local.uri, storage_options=local.storage_options, preemption=False) as on_local, \
            CheckpointManager(remote.uri, storage_options=remote.storage_options, preemption=False) as on_remote:
        yield {"local": on_local, "remote": on_remote}


def stale_copies(managers: dict[str, CheckpointManager], steps: Iterable[int]) -> dict[int, str]:
    """Of ``steps`` (committed on both tiers of ``managers``), those whose local copy is not the committed step
    of the remote tier, each with why (:meth:`~taskpoint.manager.StepDescription.not_a_copy_of`). A step
    deleted from either tier since it was listed has no copy to judge."""
    found: dict[int, str] = {}
    for number in sorted(steps):
        try:
            why = managers["local"].describe(number).not_a_copy_of(managers["remote"].describe(number))
        except FileNotFoundError:
            continue
        if why is not None:
            found[number] = why
    return found
