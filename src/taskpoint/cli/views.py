"""``taskpoint ls`` and ``taskpoint show``: what a URI holds, read with the library's own code."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

import click

from ..errors import CheckpointCorruptError
from ..format.fileset import FileEntry, FileSetManifest
from ..format.records import FILESET_CODEC, MANIFEST_SUFFIX, StepManifest
from ..manager import CheckpointManager, KeepBest
from ..manager.chunks import CHUNK_FOLDER
from ..manager.claims import Claims
from ..manager.steps import MANIFEST_NAME, RESTORE_LEASE, STEP_FOLDER, StepStore
from ..record import read_record
from ..runtime import layout
from ..storage import Location
from ._app import ERROR, OK, _command, _Failed, _Missing, _state, cli

#: What ``ls`` and ``show`` say of a step whose manifest carries no check.
UNCHECKED = ("manifest unchecked: written by a taskpoint older than manifest checks, so damage to the manifest "
             "itself cannot be detected; save the step again to have it checked")
#: The states ``ls`` gives without reading a byte of the data (listing sizes, and chunks present or not).
SIZE_JUDGED = frozenset({"saved", "committed"})


def _location(uri: str) -> Location:
    return Location(uri.rstrip("/") if not uri.endswith("://") else uri, _state().storage_options())


def _object_size(loc: Location) -> int | None:
    """The size of the object at ``loc``; None when there is none (or it is a folder)."""

    def info() -> int | None:
        try:
            found = loc.fs.info(loc.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if found.get("type") == "directory":
            return None
        return int(found.get("size") or 0)

    return loc.run(info, action="check")


def _steps(loc: Location) -> StepStore:
    return StepStore(loc, Claims((str(loc.fs.protocol), loc.path)))


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


def fileset_files(steps: StepStore, step: int, manifest: StepManifest) -> dict[str, FileEntry] | None:
    """The files a DCP step (taskpoint.torch) holds, as its file-set manifest lists them (DCP's ``.metadata``
    too); None for any other kind of step. _Missing when that manifest is gone, CheckpointCorruptError when it
    is damaged."""
    if manifest.record.codec != FILESET_CODEC:
        return None
    files = steps.object(step, manifest.payload)
    data = files.read_small()
    if data is None:
        raise _Missing(f"its manifest of files {manifest.payload} is missing")
    return FileSetManifest.from_bytes(data, files.uri).files


def _checkpoint_view(loc: Location) -> dict[str, Any] | None:
    """A checkpoint object and its record (``<uri>.taskpoint.json``); None when neither is there."""
    record = read_record(loc.sibling(MANIFEST_SUFFIX))
    size = _object_size(loc)
    if record is None and size is None:
        return None
    # The entry a load verifies the object against: the newest listed one of the stored size.
    visible = record.of_size(size) if record is not None and size is not None else None
    confirmed = record.confirmed if record is not None else None
    # current: the stored object (a load reads it); confirmed: the record's own bookkeeping (a later save by the
    # same process saw this one return, so the record keeps it), false for the newest object of a healthy
    # checkpoint until the next save.
    objects = [{**asdict(entry), "current": visible is not None and entry.save_id == visible.save_id,
                "confirmed": entry.save_id == confirmed, "size_matches": entry.size == size}
               for entry in (record.objects if record is not None else ())]
    if record is None:
        state = "unrecorded"  # Flyte's, or written by hand: only the archive's own checks apply
    elif size is None:
        state = "missing"
    elif visible is None:
        state = "damaged"
    else:
        state = "saved"
    return {"type": "checkpoint", "uri": loc.uri, "state": state, "size": size,
            "kind": visible.kind if visible else (objects[0]["kind"] if objects else None),
            "created": visible.created if visible else None, "objects": objects,
            "record": None if record is None else loc.sibling(MANIFEST_SUFFIX).uri}


def _manager_view(loc: Location, metric: str | None = None) -> dict[str, Any] | None:
    """The steps of a CheckpointManager directory (with the value of ``metric`` in each step's metadata, when
    named); None when it holds no ``ckpt-N`` folder."""
    root = loc.path.rstrip("/")
    listing = loc.list_tree()
    sizes: dict[int, dict[str, int]] = {}
    stored_chunks: set[str] = set()  # the chunk store of deduplicated steps, by key
    for path, info in listing.items():
        parts = path[len(root) + 1:].split("/") if path.startswith(root + "/") else []
        if len(parts) == 3 and parts[0] == CHUNK_FOLDER and info.get("type") != "directory":
            stored_chunks.add(parts[2])
        match = STEP_FOLDER.fullmatch(parts[0]) if parts else None
        if match is None:
            continue
        names = sizes.setdefault(int(match.group(1)), {})
        if len(parts) == 2 and parts[1] and info.get("type") != "directory":
            names[parts[1]] = int(info.get("size") or 0)
    if not sizes:
        return None
    steps = _steps(loc)
    rows = []
    for step, names in sorted(sizes.items()):
        leases = sorted(n for n in names if RESTORE_LEASE.fullmatch(n))
        names = {n: size for n, size in names.items() if n not in leases}
        row: dict[str, Any] = {"step": step, "uri": steps.step_uri(step), "state": "incomplete", "size": None,
                               "created": None, "attempt": None, "kind": None, "metadata_keys": [],
                               "leftovers": sorted(n for n in names if n != MANIFEST_NAME), "restore_leases": leases}
        if MANIFEST_NAME in names:
            try:
                manifest = steps.manifest(step)
            except CheckpointCorruptError as exc:
                row.update(state="damaged", problem=" ".join(str(exc).split()))
                rows.append(row)
                continue
            assert manifest is not None
            record = manifest.record
            # The objects of the step's folder its manifest names: none for a deduplicated step (chunks, below).
            objects = ([(s.payload, s.record) for s in manifest.shards] if manifest.shards is not None
                       else [] if manifest.tree is not None else [(manifest.payload, record)])
            named = {MANIFEST_NAME, *(name for name, _ in objects)}
            row.update(size=record.size, created=record.created, attempt=manifest.attempt, kind=record.kind,
                       metadata_keys=sorted(manifest.metadata), payload=manifest.payload,
                       leftovers=sorted(n for n in names if n not in named), checked=manifest.checked)
            if metric is not None:
                row["metric"] = manifest.metadata.get(metric)
            if manifest.shards is not None:
                row["shards"] = len(manifest.shards)
            row["state"] = "committed"
            if manifest.tree is not None:  # deduplicated: its bytes are chunks in the shared store
                row["chunks"] = manifest.tree.chunk_count()
                missing = next(((entry.path, key) for entry in manifest.tree.entries for key in entry.chunks
                                if key not in stored_chunks), None)
                if missing is not None:
                    row.update(state="damaged", problem=f"file {missing[0]!r} needs chunk {missing[1]}, which is "
                                                        "missing")
            for name, part in objects:
                stored = names.get(name)
                if stored is None:
                    row.update(state="damaged", problem=f"its payload {name} is missing")
                elif stored != part.size:
                    row.update(state="damaged", problem=f"its payload holds {stored} bytes, the manifest records "
                                                        f"{part.size}")
                else:
                    continue
                break
            if row["state"] == "committed":
                _fileset_row(row, steps, step, manifest, names)
        rows.append(row)
    return {"type": "manager", "uri": loc.uri, "steps": rows}


def _fileset_row(row: dict[str, Any], steps: StepStore, step: int, manifest: StepManifest,
                 names: dict[str, int]) -> None:
    """A DCP step's size is the data it holds (every file its file-set manifest lists, not that manifest), and
    it is committed only when each of those files is stored with its listed size."""
    try:
        files = fileset_files(steps, step, manifest)
    except (CheckpointCorruptError, _Missing) as exc:
        row.update(state="damaged", problem=" ".join(str(exc).split()))
        return
    if files is None:
        return
    row.update(size=sum(entry.size for entry in files.values()), files=len(files),
               leftovers=[name for name in row["leftovers"] if name not in files])
    for name, entry in sorted(files.items()):
        stored = names.get(name)
        if stored != entry.size:
            row.update(state="damaged", problem=f"its file {name} is missing" if stored is None else
                       f"its file {name} holds {stored} bytes, its manifest lists {entry.size}")
            return


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


def _what(loc: Location, metric: str | None = None) -> dict[str, Any]:
    """What the URI holds: a checkpoint object, a manager directory (each step's ``metric`` too, when named) or
    a task root; _Missing otherwise."""
    view = _checkpoint_view(loc) or _manager_view(loc, metric) or _task_root_view(loc)
    if view is None:
        if loc.container_missing():
            raise _Failed(ERROR, f"{loc.uri}: the bucket or container does not exist. Create it, or fix the URI.")
        raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
    return view


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
@_command
def ls_command(uri: str, as_json: bool, metric: str | None, mode: str) -> int:
    """List what URI holds: a checkpoint object, a CheckpointManager directory, or a task root.

    A checkpoint object shows its record (<uri>.taskpoint.json); a manager directory its steps (state, size,
    save time, attempt, metadata keys); a task root its runs, actions and attempts. A size is the data a step
    holds: its payload as stored, every file of a DCP step, the plain bytes of a deduplicated step's files.
    States come from the listing and the manifests: sizes are compared, no byte is read (a note below the
    output says so); `taskpoint verify` checks every byte. A time or attempt that is not known prints `-`.
    MARK names the steps retention never deletes (`protected`: the newest step that verifies, a step with a
    restore lease) and, with --best, the best step by a metric of their metadata (as keep_best judges it).

    \b
    Examples:
      taskpoint ls ./.taskpoint
      taskpoint ls s3://bucket/runs/job7/train/steps --json
      taskpoint ls gs://bucket/ckpt -o token=anon
    """
    view = _what(_location(uri), metric)
    if view["type"] == "manager":
        _mark(view, None if metric is None else KeepBest(metric, mode))
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
        click.echo(f"{'STEP':>6}  {'STATE':<10}  {'KIND':<9}  {'SIZE':>10}  {'SAVED (UTC)':<19}  ATTEMPT  "
                   f"{'METADATA':<16}  MARK")
        for row in view["steps"]:
            attempt = "-" if row["attempt"] is None else str(row["attempt"])
            state = row["state"] + ("*" if row.get("checked") is False else "")
            marks = [f"best ({metric}={row['metric']})"] if row.get("best") else []
            marks += [f"protected: {row['protected']}"] if row["protected"] else []
            click.echo(f"{row['step']:>6}  {state:<10}  {row['kind'] or '-':<9}  {_human(row['size']):>10}  "
                       f"{_time(row['created']):<19}  {attempt:>7}  {','.join(row['metadata_keys']) or '-':<16}  "
                       f"{', '.join(marks) or '-'}")
        if any(row.get("checked") is False for row in view["steps"]):
            click.echo(f"* {UNCHECKED}")
        judged = [row for row in view["steps"] if row["state"] in SIZE_JUDGED]
        if judged:
            click.echo(_sizes_only(view["uri"], chunks=any("chunks" in row for row in judged)))
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


@cli.command("show")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="the step of a manager directory (default: the newest)")
@click.option("--json", "as_json", is_flag=True, help="print JSON for machines")
@_command
def show_command(uri: str, step: int | None, as_json: bool) -> int:
    """Show the record of a checkpoint object, or the manifest and user metadata of one step.

    A record lists the objects that may be stored at the URI, newest first; `current` marks the one stored
    now, which a load reads and verifies. The others are kept in case a save's answer was lost. With --json
    each object also has `size_matches` (its size is the stored object's) and `confirmed`: the record's own
    bookkeeping (a later save by the same process saw this save return, so the record keeps it however many
    saves follow); the newest object of a healthy checkpoint is not confirmed until the next save, which says
    nothing about its health. A step's size is the data it holds (for a DCP step every file it lists, for a
    deduplicated one the plain bytes of its files). A value that is not known prints `-`.

    \b
    Examples:
      taskpoint show ./.taskpoint/job7/train/3/checkpoint
      taskpoint show s3://bucket/runs/steps --step 1200 --json
    """
    loc = _location(uri)
    view = None if step is not None else _checkpoint_view(loc)
    if view is None:
        with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
            chosen = step if step is not None else manager.latest_step()
            if chosen is None:
                if _task_root_view(loc) is not None:
                    raise _Failed(ERROR, f"{loc.uri} is a task root: give one attempt's checkpoint or a steps "
                                         "folder (taskpoint ls lists them)")
                raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
        manifest = _steps(loc).manifest(chosen)
        if manifest is None:
            raise _Missing(f"step {chosen} does not exist in {loc.uri}")
        view = {"type": "step", "uri": _steps(loc).step_uri(chosen), "step": manifest.step,
                "payload": manifest.payload, "attempt": manifest.attempt, **asdict(manifest.record),
                "checked": manifest.checked, "metadata": manifest.metadata}
        files = fileset_files(_steps(loc), chosen, manifest)
        if files is not None:  # a DCP step: its payload is the manifest of the files that hold its data
            view.update(size=sum(entry.size for entry in files.values()), payload_size=manifest.record.size,
                        files=len(files))
        if manifest.shards is not None:
            view["shards"] = [{"rank": s.rank, "payload": s.payload, "size": s.record.size,
                               "sha256": s.record.sha256} for s in manifest.shards]
        if manifest.tree is not None:  # deduplicated: each file's bytes are chunks of the shared store
            tree = manifest.tree
            view.update(files=tree.count("file"), folders=tree.count("dir"), links=tree.count("link"),
                        chunk_size=tree.chunk_size, chunks=tree.chunk_count(), unique_chunks=len(tree.chunk_keys()))
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


