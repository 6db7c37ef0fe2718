"""``taskpoint pull``, ``push``, ``rm`` and ``gc``: move checkpoints and clean up, with the API's guarantees."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from .. import Checkpoint, CheckpointManager, TransferStats
from ..storage import Location, safe_uri
from ._app import ERROR, OK, _command, _Failed, _Missing, cli, logger, progress_option
from .holdings import _checkpoint_view, _location, target
from .views import _human


@contextmanager
def _transfers() -> Iterator[list[TransferStats]]:
    """The figures of the saves and loads inside the block, from taskpoint's own log records."""
    found: list[TransferStats] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stats = getattr(record, "transfer", None)
            if isinstance(stats, TransferStats):
                found.append(stats)

    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


#: Transfers smaller than this report no rate: their time is mostly round trips and set-up, not throughput.
RATE_MIN_BYTES = 1 << 20


def _figures(stats: TransferStats, moved: str = "") -> str:
    """What a pull or push moved, in how long, and (above :data:`RATE_MIN_BYTES`) how fast."""
    rate = stats.bytes / stats.total_seconds if stats.total_seconds > 0 and stats.bytes >= RATE_MIN_BYTES else None
    speed = "" if rate is None else f", {_human(int(rate))}/s"
    return f"{stats.kind}, {_human(stats.bytes)}{moved} in {_seconds(stats.total_seconds)}{speed}"


def _seconds(seconds: float) -> str:
    """A duration with a unit that keeps it readable: milliseconds below one second."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


@cli.command("pull")
@click.argument("uri")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="the step of a manager directory (default: the newest)")
@click.option("--path", "paths", multiple=True, metavar="PATH",
              help="only this file or folder of the saved directory (repeatable); only its bytes are read")
@progress_option
@_command
def pull_command(uri: str, dest: Path, step: int | None, paths: tuple[str, ...], progress: bool | None) -> int:
    """Load a checkpoint (or a manager's step) into the folder DEST, verified as the API loads it.

    A directory checkpoint's entries replace same-named entries in DEST; bytes and file checkpoints land as
    DEST/payload. Nothing lands before the checksum matches. With --path, only those files and folders
    (exit 3 naming one that is not there).

    \b
    Examples:
      taskpoint pull s3://bucket/runs/job7/train/3/checkpoint ./restored
      taskpoint pull s3://bucket/runs/steps ./restored --step 1200
      taskpoint pull s3://bucket/runs/steps ./model --path model/ --path config.json
    """
    loc, step = target(uri, step)
    only = list(paths) or None
    with _transfers() as seen:
        if _single(loc, step):
            with Checkpoint(loc.uri, loc.uri, storage_options=loc.storage_options, workspace=dest) as cp:
                result = cp.load_sync(only, progress=progress)
            if result is None:
                raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
        else:
            with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
                chosen = manager.latest_step() if step is None else step
                if chosen is None:
                    raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
                manager.describe(chosen)  # imports the step's kind (torch, for a state dict) outside the restore's time
                result = manager.restore(chosen, into=dest, paths=only, progress=progress)
    click.echo(f"pulled {safe_uri(loc.uri)} -> {result}" + (f" ({_figures(seen[-1])})" if seen else ""))
    return OK


def _single(loc: Location, step: int | None) -> bool:
    """Whether URI is a single checkpoint (a record or an object there) rather than a manager directory."""
    return step is None and _checkpoint_view(loc) is not None


@cli.command("cat")
@click.argument("uri")
@click.argument("path")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="the step of a manager directory (default: the newest)")
@_command
def cat_command(uri: str, path: str, step: int | None) -> int:
    """Write the file PATH of a saved directory (a checkpoint, or a manager's step) to standard output.

    Only the compressed members or chunks that hold it are read, each verified before its bytes are written
    (exit 2 when one is damaged, 3 when PATH is not there).

    \b
    Examples:
      taskpoint cat s3://bucket/runs/steps config.json --step 1200
      taskpoint cat s3://bucket/runs/job7/train/3/checkpoint model/model.pt > model.pt
    """
    loc, step = target(uri, step)
    if _single(loc, step):
        with Checkpoint(loc.uri, loc.uri, storage_options=loc.storage_options) as cp:
            source = cp.open(path)
    else:
        with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
            at = manager.latest_step() if step is None else step
            if at is None:
                raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
            source = manager.open(at, path)
    out = sys.stdout.buffer
    with source:
        shutil.copyfileobj(source, out, 1 << 20)
    out.flush()
    return OK


@cli.command("push")
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="save as this step of a manager directory (URI is then the directory)")
@click.option("--metadata", default=None, metavar="JSON", help="with --step: the step's metadata, a JSON object")
@click.option("--overwrite", is_flag=True, help="with --step: replace the step if it exists")
@click.option("--dedup", is_flag=True,
              help="with --step: save a deduplicated step (only chunks the directory's chunk store lacks are uploaded)")
@click.option("--codec", type=click.Choice(["gzip", "zstd", "none"]), default=None,
              help="archive codec for folders (default gzip); with --dedup, each chunk's (default zstd)")
@progress_option
@_command
def push_command(src: Path, uri: str, step: int | None, metadata: str | None, overwrite: bool, dedup: bool,
                 codec: str | None, progress: bool | None) -> int:
    """Save the file or folder SRC to URI (atomic, checksummed, as the API saves).

    \b
    Examples:
      taskpoint push ./model s3://bucket/runs/job7/train/1/checkpoint
      taskpoint push ./model s3://bucket/runs/steps --step 1200 --metadata '{"loss": 0.31}'
      taskpoint push ./model s3://bucket/runs/steps --step 1300 --dedup
    """
    loc = _location(uri)
    if step is None and (metadata is not None or overwrite or dedup):
        raise _Failed(ERROR, "--metadata, --overwrite and --dedup go with --step (a manager directory)")
    with _transfers() as seen:
        if step is None:
            with Checkpoint(loc.uri, storage_options=loc.storage_options, codec=codec or "gzip") as cp:
                cp.save_sync(src, progress=progress)
            where = loc.uri
        else:
            try:
                meta = json.loads(metadata) if metadata is not None else None
            except ValueError as exc:
                raise _Failed(ERROR, f"--metadata must be a JSON object: {exc}") from None
            with CheckpointManager(loc.uri, storage_options=loc.storage_options, codec=codec,
                                   dedup=dedup, preemption=False) as manager:
                where = manager.save(src, step, metadata=meta, overwrite=overwrite, progress=progress)
    moved = " of new chunks" if dedup else ""
    click.echo(f"pushed {src} -> {safe_uri(where)}" + (f" ({_figures(seen[-1], moved)})" if seen else ""))
    return OK


# -- rm and gc ------------------------------------------------------------------------------------------------


@cli.command("rm")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="the step to delete (needed unless URI is the step's folder)")
@click.option("--force", is_flag=True, help="delete a protected step too (the newest committed step that verifies, "
              "or one another process is restoring)")
@_command
def rm_command(uri: str, step: int | None, force: bool) -> int:
    """Delete one step of a CheckpointManager directory (its manifest first, so it stops existing at once).

    The step is --step N of the directory URI, or the step's folder as URI (.../ckpt-N, as show prints it). A
    protected step is refused (exit 1, naming the rule) unless --force: the newest committed step that
    verifies, and a step another process is restoring.

    \b
    Examples:
      taskpoint rm s3://bucket/runs/steps --step 1100
      taskpoint rm s3://bucket/runs/steps/ckpt-1100
    """
    loc, step = target(uri, step)
    if step is None:
        raise _Failed(ERROR, "give the step to delete: --step N, or the step's folder as URI (.../ckpt-N)")
    with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
        manager.delete(step, force=force)
    click.echo(f"deleted step {step} of {safe_uri(loc.uri)}")
    return OK


@cli.command("gc")
@click.argument("directory")
@click.option("--grace", type=click.FloatRange(min=0), default=None,
              help="only remove leftovers older than this many seconds (default: the manager's)")
@click.option("--dry-run", is_flag=True, help="list what would be removed, remove nothing")
@_command
def gc_command(directory: str, grace: float | None, dry_run: bool) -> int:
    """Remove leftovers of interrupted saves under a CheckpointManager directory (committed steps stay).

    On S3 this also aborts unfinished multipart uploads of payloads. Storage options come from
    --storage-option and $TASKPOINT_STORAGE_OPTIONS (a JSON object), as for tasks.

    \b
    Examples:
      taskpoint gc s3://bucket/runs/steps --dry-run
      taskpoint gc ./checkpoints --grace 0
    """
    loc = _location(directory)
    with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
        removed = manager.gc(grace_seconds=grace, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for found in removed:
        click.echo(f"{verb} {safe_uri(found)}")
    click.echo(f"taskpoint gc: {len(removed)} leftover(s) {verb.replace('would remove', 'would be removed')}")
    return OK
