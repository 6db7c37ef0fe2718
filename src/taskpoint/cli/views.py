"""``taskpoint ls`` and ``taskpoint show``: what a URI holds (read by :mod:`.holdings`), printed as tables,
lines or JSON."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import click

from ..manager import CheckpointManager, KeepBest, StepDescription
from ..storage import Location
from ._app import ERROR, OK, _command, _Failed, _Missing, cli
from .holdings import (
    _checkpoint_view,
    _local_dir,
    _location,
    _task_root_view,
    _tier_managers,
    _tiers_view,
    _what,
    stale_copies,
    target,
)

#: What ``ls`` and ``show`` say of a step whose manifest carries no check.
UNCHECKED = ("manifest unchecked: written by a taskpoint older than manifest checks, so damage to the manifest "
             "itself cannot be detected; save the step again to have it checked")
#: The states ``ls`` gives without reading a byte of the data (listing sizes, and chunks present or not).
SIZE_JUDGED = frozenset({"saved", "committed"})
#: The option of ``ls``, ``show`` and ``verify`` that names a manager's local tier (``local_dir``).
local_dir_option = click.option(
    "--local-dir", "local_dir", default=None, metavar="PATH",
    help="the local tier of a manager directory (its local_dir): steps of both tiers, each with its tier")


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _human(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _sizes_only(uri: str, chunks: bool = False) -> str:
    """The note below ``ls`` output whose states come from sizes alone (``chunks``: deduplicated steps, from
    chunks being stored)."""
    judged = "sizes compared only (deduplicated steps: each chunk is stored)" if chunks else "sizes compared only"
    return f"{judged}; run `taskpoint verify {uri}` to check every byte"


def _table(headers: list[str], rows: list[list[str]], right: set[str]) -> list[str]:
    """Lines of a table whose columns are as wide as their widest value (numbers in ``right`` aligned right),
    two spaces apart; the last column is not padded."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = []
    for cells in [headers, *rows]:
        padded = [cell.rjust(width) if header in right else cell.ljust(width)
                  for header, cell, width in zip(headers, cells, widths, strict=True)]
        lines.append("  ".join(padded).rstrip())
    return lines


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


# -- ls -------------------------------------------------------------------------------------------------------


def _mark(view: dict[str, Any], best: KeepBest | None) -> None:
    """Mark the steps of a manager view that retention never deletes (``protected``: the rule), and with
    ``best`` the best step by its metric (``best``: True), as CheckpointManager judges them from a listing."""
    committed = [row for row in view["steps"] if row["state"] == "committed"]
    for row in view["steps"]:
        row["protected"] = "restore lease" if row["restore_leases"] and row["state"] == "committed" else None
    if committed:
        committed[-1]["protected"] = "newest that verifies"
    if best is not None:
        ranked = best.best({row["step"]: best.value({best.metric: row.get("metric")}) for row in committed})
        for row in view["steps"]:
            row["best"] = bool(ranked) and row["step"] == ranked[0]


@cli.command("ls")
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True, help="print JSON for machines")
@click.option("--best", "metric", default=None, metavar="METRIC",
              help="mark the best step by this key of the steps' metadata (the lowest; --mode max: the highest)")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True,
              help="with --best: whether the lowest or the highest value is best")
@local_dir_option
@_command
def ls_command(uri: str, as_json: bool, metric: str | None, mode: str, local_dir: str | None) -> int:
    """List what URI holds: a checkpoint object, a CheckpointManager directory, a task root, or a folder of objects.

    A checkpoint object shows its record (<uri>.taskpoint.json); a manager directory its steps (state, size,
    save time, attempt, metadata keys); a task root its runs, actions and attempts; a folder of checkpoint
    objects (the .ckpt files of the Lightning plug-in) each object; a step's folder (.../ckpt-N) that step. A
    size is the data a step holds: its payload as stored, every file of a DCP step, the plain bytes of a
    deduplicated step's files. States come from the listing and the manifests: sizes are compared, no byte is
    read (a note below the output says so); `taskpoint verify` checks every byte. A time or attempt that is not
    known prints `-`.
    MARK names the steps retention never deletes (`protected`: the newest step that verifies, a step with a
    restore lease) and, with --best, the best step by a metric of their metadata (as keep_best judges it).
    With --local-dir (a manager's local tier), each step of either tier is listed with its TIER, and MARK names
    a local copy that is not the committed step of the remote tier (`taskpoint verify --local-dir` says why).

    \b
    Examples:
      taskpoint ls ./.taskpoint
      taskpoint ls s3://bucket/runs/job7/train/steps --json
      taskpoint ls gs://bucket/ckpt -o token=anon
    """
    loc, only = target(uri, None) if local_dir is None else (_location(uri), None)
    view = _what(loc, metric) if local_dir is None else _tiers_view(uri, local_dir, metric)
    if view["type"] == "manager":
        _mark(view, None if metric is None else KeepBest(metric, mode))
        if only is not None:  # a step's folder: that step's row, marked as in its whole directory
            view["steps"] = [row for row in view["steps"] if row["step"] == only]
    if as_json:
        _print_json(view)
    elif view["type"] == "checkpoint":
        listed = len(view["objects"])
        if view["state"] == "unrecorded":
            when = ("no record: written by Flyte or another tool, or its record was removed; a load cannot verify "
                    "it")
        else:
            saved = f"saved {_time(view['created'])} UTC  " if view["created"] is not None else ""
            when = f"{saved}({listed} object(s) in its record)"
        click.echo(f"{view['uri']}  {view['state']}  {view['kind'] or '-'}  {_human(view['size'])}  {when}")
        if view["state"] in SIZE_JUDGED:
            click.echo(_sizes_only(view["uri"]))
    elif view["type"] == "manager":
        click.echo(f"{view['uri']}: {sum(r['state'] == 'committed' for r in view['steps'])} committed step(s)")
        tiers = local_dir is not None
        cells = []
        for row in view["steps"]:
            marks = [f"best ({metric}={row['metric']})"] if row.get("best") else []
            marks += [f"protected: {row['protected']}"] if row["protected"] else []
            marks += ["not the committed step (taskpoint verify says why)"] if row.get("not_the_committed_step") else []
            cells.append([str(row["step"]), *([row["tier"]] if tiers else []),
                          row["state"] + ("*" if row.get("checked") is False else ""), row["kind"] or "-",
                          _human(row["size"]), _time(row["created"]),
                          "-" if row["attempt"] is None else str(row["attempt"]),
                          ",".join(row["metadata_keys"]) or "-", ", ".join(marks) or "-"])
        headers = ["STEP", *(["TIER"] if tiers else []), "STATE", "KIND", "SIZE", "SAVED (UTC)", "ATTEMPT",
                   "METADATA", "MARK"]
        for line in _table(headers, cells, right={"STEP", "SIZE", "ATTEMPT"}):
            click.echo(line)
        if any(row.get("checked") is False for row in view["steps"]):
            click.echo(f"* {UNCHECKED}")
        judged = [row for row in view["steps"] if row["state"] in SIZE_JUDGED]
        if judged:
            click.echo(_sizes_only(view["uri"], chunks=any("chunks" in row for row in judged)))
    elif view["type"] == "folder":
        click.echo(f"{view['uri']}: {len(view['checkpoints'])} checkpoint(s)")
        cells = [[entry["uri"].rpartition("/")[2], entry["state"], entry["kind"] or "-", _human(entry["size"]),
                  _time(entry["created"])] for entry in view["checkpoints"]]
        for line in _table(["NAME", "STATE", "KIND", "SIZE", "SAVED (UTC)"], cells, right={"SIZE"}):
            click.echo(line)
        if any(entry["state"] in SIZE_JUDGED for entry in view["checkpoints"]):
            click.echo(_sizes_only(view["uri"]))
    else:
        click.echo(f"{view['uri']}: {len(view['actions'])} action(s)")
        for row in view["actions"]:
            attempts = " ".join(f"{a['attempt']}" + (f"({_human(a['checkpoint_size'])})"
                                                     if a["checkpoint_size"] is not None else "")
                                for a in row["attempts"]) or "-"
            steps = f"  steps {row['steps'][0]}..{row['steps'][-1]} ({len(row['steps'])})" if row["steps"] else ""
            click.echo(f"  {row['path'] or '.'}  attempts {attempts}{steps}")
    return OK


# -- show -----------------------------------------------------------------------------------------------------


def _step_view(described: StepDescription) -> dict[str, Any]:
    """What ``show`` prints of one step of a manager directory."""
    return {"type": "step", "uri": described.uri, "step": described.step, "payload": described.payload,
            "attempt": described.attempt, "kind": described.payload_kind, "codec": described.codec,
            "save_id": described.save_id, "created": described.created, "size": described.size,
            **described.checked_by, "crc32": described.crc32, "checked": described.checked,
            "metadata": described.metadata, **described.details}


def _tier_step_view(remote: Location, local: Location, step: int | None) -> dict[str, Any]:
    """``step`` (the newest of either tier when None) of a manager directory and its local tier: described from
    its local copy when it has one that is the committed step (else from the remote copy, with ``local_copy``
    saying why not), with ``tiers``, the tiers that hold it; _Missing when neither does."""
    with _tier_managers(remote, local) as managers:
        held = {tier: set(manager.steps()) for tier, manager in managers.items()}
        chosen = step if step is not None else max(held["local"] | held["remote"], default=None)
        tiers = [tier for tier in managers if chosen in held[tier]]
        if chosen is None or not tiers:
            what = "no committed step" if chosen is None else f"no step {chosen}"
            raise _Missing(f"there is {what} in {remote.uri} or {local.uri}")
        stale = stale_copies(managers, [chosen] if len(tiers) == len(managers) else []).get(chosen)
        shown = "remote" if stale is not None else tiers[0]
        return {**_step_view(managers[shown].describe(chosen)), "tiers": ", ".join(tiers),
                **({"local_copy": stale} if stale is not None else {})}


@cli.command("show")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="the step of a manager directory (default: the newest)")
@click.option("--json", "as_json", is_flag=True, help="print JSON for machines")
@local_dir_option
@_command
def show_command(uri: str, step: int | None, as_json: bool, local_dir: str | None) -> int:
    """Show the record of a checkpoint object, or the manifest and user metadata of one step.

    A record lists the objects that may be stored at the URI, newest first; `current` marks the one stored
    now, which a load reads and verifies. The others are kept in case a save's answer was lost. With --json
    each object also has `size_matches` (its size is the stored object's) and `confirmed`: the record's own
    bookkeeping (a later save by the same process saw this save return, so the record keeps it however many
    saves follow); the newest object of a healthy checkpoint is not confirmed until the next save, which says
    nothing about its health. A step's size is the data it holds (for a DCP step every file it lists, for a
    deduplicated one the plain bytes of its files). A value that is not known prints `-`. With --local-dir (a
    manager's local tier) the step is the newest of either tier, shown from its local copy when it has one that
    is the committed step (else from the remote copy, `local_copy` saying why), and `tiers` says which tiers
    hold it.

    \b
    Examples:
      taskpoint show ./.taskpoint/job7/train/3/checkpoint
      taskpoint show s3://bucket/runs/steps --step 1200 --json
    """
    loc, step = target(uri, step)
    view = None if step is not None or local_dir is not None else _checkpoint_view(loc)
    if view is None and local_dir is not None:
        view = _tier_step_view(loc, _local_dir(local_dir), step)
    if view is None:
        with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
            chosen = step if step is not None else manager.latest_step()
            if chosen is None:
                if _task_root_view(loc) is not None:
                    raise _Failed(ERROR, f"{loc.uri} is a task root: give one attempt's checkpoint or a steps "
                                         "folder (taskpoint ls lists them)")
                raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
            view = _step_view(manager.describe(chosen))
    if as_json:
        _print_json(view)
        return OK
    for key, value in view.items():
        if key == "objects" and not value:
            click.echo("objects: -")
        elif key == "objects":
            click.echo("objects (newest first; current: the object stored now, which a load reads):")
            for entry in value:
                click.echo(f"  - {_object_line(entry)}")
        elif key == "metadata":
            click.echo("metadata: " + json.dumps(value, indent=2, sort_keys=True).replace("\n", "\n  "))
        elif key == "created":
            click.echo(f"created: {_when(value)}")
        elif key == "checked" and not value:
            click.echo(f"checked: no ({UNCHECKED})")
        elif key == "payload" and not value:
            continue  # a deduplicated step or one of several ranks: no payload object of its own
        elif key == "sha256" and value is None:
            continue  # checked by BLAKE3 (pieces), by chunks or by shards: what it is checked by is printed instead
        elif key == "piece_digests":
            click.echo("piece_digests (BLAKE3 of each piece, in order):")
            for index, digest in enumerate(value):
                click.echo(f"  - piece {index}: {digest}")
        else:
            click.echo(f"{key}: {'-' if value is None else value}")
    return OK


def _when(seconds: float | None) -> str:
    return "-" if seconds is None else f"{_time(seconds)} UTC"


def _object_line(entry: dict[str, Any]) -> str:
    """One object of a record for ``show``: whether it is the stored one, then its fields (``-``: not known);
    the record's bookkeeping (``confirmed``, ``size_matches``) only in --json."""
    status = "current" if entry["current"] else "listed, not stored now"
    fields = ", ".join(f"{k}={_when(v) if k == 'created' else '-' if v is None else v}" for k, v in entry.items()
                       if k not in ("current", "confirmed", "size_matches"))
    return f"{status}: {fields}"


# -- verify ---------------------------------------------------------------------------------------------------


