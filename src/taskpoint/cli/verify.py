"""``taskpoint verify``: stream every stored byte through its recorded checksum, extracting nothing."""

from __future__ import annotations

import time

import click

from ..errors import CheckpointCorruptError, CheckpointError, NewerFormatError
from ..manager import CheckpointManager, StepVerification, Verification
from ..storage import Location
from ._app import OK, _command, _Missing, cli, progress_option
from .holdings import _checkpoint, _checkpoint_view, _local_dir, _tier_managers, folder_objects, stale_copies, target
from .views import UNCHECKED, _human, local_dir_option

#: What the summary of NEWER lines says.
UPGRADE = "written by a newer taskpoint (upgrade taskpoint to verify them)"


def step_line(result: StepVerification) -> str:
    """The line of a verified step: healthy with what matched, DAMAGED with the problem, NEWER with the document
    a newer taskpoint wrote, or not checked."""
    if result.state == "damaged":
        return f"step {result.step}: DAMAGED: {result.detail}"
    if result.state == "newer":
        return f"step {result.step}: NEWER: {result.detail}"
    if result.state == "changed":
        return f"step {result.step}: not checked: overwritten or deleted while it was verified"
    unchecked = "" if result.checked else f"; {UNCHECKED}"
    return f"step {result.step}: healthy ({_human(result.size)}, {result.detail}){unchecked}"


def report(verification: Verification) -> None:
    """Print each step's line, then raise as :func:`check` does."""
    for result in verification.steps:
        click.echo(step_line(result))
    check(verification)


def check(verification: Verification) -> None:
    """CheckpointCorruptError when a step of ``verification`` is damaged (exit 2); else NewerFormatError when any
    was written by a newer taskpoint (exit 4: the worse news first, and a newer step is no damage); else
    CheckpointError when any was overwritten or deleted after the listing (another writer, or its retention)."""
    total, directory = len(verification.steps), verification.directory
    if verification.damaged:
        raise CheckpointCorruptError(f"{len(verification.damaged)} of {total} step(s) in {directory} are damaged: "
                                     f"{', '.join(map(str, verification.damaged))}")
    if verification.newer:
        raise NewerFormatError(f"{len(verification.newer)} of {total} step(s) in {directory} were {UPGRADE}: "
                               f"{', '.join(map(str, verification.newer))}")
    if verification.changed:
        raise CheckpointError(f"{len(verification.changed)} of {total} step(s) in {directory} were overwritten or "
                              f"deleted while they were verified (another writer, or its retention): "
                              f"{', '.join(map(str, verification.changed))}; verify again")


@cli.command("verify")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="check only this step of a manager directory (default: every committed step)")
@progress_option
@local_dir_option
@_command
def verify_command(uri: str, step: int | None, progress: bool | None, local_dir: str | None) -> int:
    """Stream every byte of a checkpoint (or of a manager's steps) and check it against its recorded checksum.

    Nothing is extracted: the stored bytes are hashed as they stream. Exit code 0 healthy, 1 error (storage,
    usage, a step overwritten or deleted while it was verified; with --local-dir, a local copy that is not the
    committed step of the remote tier), 2 damaged (the object or step is named), 3 not found, 4 newer (written
    by a newer taskpoint: upgrade taskpoint to verify it).

    \b
    Examples:
      taskpoint verify ./.taskpoint/job7/train/3/checkpoint
      taskpoint verify s3://bucket/runs/steps --step 1200 && echo intact
      taskpoint verify s3://bucket/runs/steps --local-dir /nvme/steps    (both tiers, each line with its tier)
    """
    loc, step = target(uri, step)
    started = time.perf_counter()
    if local_dir is not None:
        return _verify_tiers(loc, _local_dir(local_dir), step, progress, started)
    if step is None and _checkpoint_view(loc) is not None:
        click.echo(_object_line(loc, progress))
        return OK
    with CheckpointManager(loc.uri, storage_options=loc.storage_options, preemption=False) as manager:
        if step is not None:
            click.echo(step_line(manager.verify(step, progress=progress).steps[0]))
            return OK
        try:
            verification = manager.verify(progress=progress)
        except FileNotFoundError:
            return _verify_folder(loc, progress, started)
    report(verification)
    click.echo(f"{loc.uri}: {len(verification.steps)} step(s) healthy in {time.perf_counter() - started:.2f} s")
    return OK


def _object_line(loc: Location, progress: bool | None) -> str:
    """Verify the checkpoint object at ``loc``: its line, healthy or readable; CheckpointCorruptError when
    damaged."""
    with _checkpoint(loc) as checkpoint:
        checked = checkpoint.verify(progress=progress)
    if checked.state == "healthy":
        return f"{loc.uri}: healthy ({_human(checked.size)}, {checked.digest} matches its record)"
    return f"{loc.uri}: readable (no recorded checksum: checked by loading it, with the archive's own checks)"


def _verify_folder(loc: Location, progress: bool | None, started: float) -> int:
    """``verify`` of a folder of checkpoint objects (the ``.ckpt`` files of the Lightning plug-in): a line for
    each, then CheckpointCorruptError naming the damaged ones; _Missing when the folder holds none."""
    objects = folder_objects(loc)
    if not objects:
        raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
    damaged, newer = [], []
    for found in objects:
        try:
            click.echo(_object_line(found, progress))
        except NewerFormatError as exc:
            click.echo(f"{found.uri}: NEWER: {' '.join(str(exc).split())}")
            newer.append(found.uri.rpartition("/")[2])
        except CheckpointCorruptError as exc:
            click.echo(f"{found.uri}: DAMAGED: {' '.join(str(exc).split())}")
            damaged.append(found.uri.rpartition("/")[2])
        except FileNotFoundError:  # deleted since the listing (Lightning's top-k, for one)
            click.echo(f"{found.uri}: not checked: deleted while the folder was verified")
    if damaged:
        raise CheckpointCorruptError(f"{len(damaged)} of {len(objects)} checkpoint(s) in {loc.uri} are damaged: "
                                     f"{', '.join(damaged)}")
    if newer:
        raise NewerFormatError(f"{len(newer)} of {len(objects)} checkpoint(s) in {loc.uri} were {UPGRADE}: "
                               f"{', '.join(newer)}")
    click.echo(f"{loc.uri}: {len(objects)} checkpoint(s) checked in {time.perf_counter() - started:.2f} s")
    return OK


# -- both tiers of a manager (--local-dir) --------------------------------------------------------------------


def _verify_tiers(remote: Location, local: Location, step: int | None, progress: bool | None, started: float) -> int:
    """``verify --local-dir``: the steps of both tiers of a manager (``step`` alone: on every tier that holds it),
    each line prefixed with its tier, then a line for each local copy that is not the committed step of the
    remote tier (:func:`.holdings.stale_copies`); exit codes as for one directory, and 1 for such a copy."""
    found: dict[str, Verification] = {}
    with _tier_managers(remote, local) as managers:
        for tier, manager in managers.items():
            listed = manager.steps()
            if step is not None and step in listed:
                found[tier] = manager.verify(step, progress=progress)
            elif step is None and listed:
                found[tier] = manager.verify(progress=progress)
        if not found:
            what = "nothing taskpoint saved is" if step is None else f"step {step} is on neither tier"
            raise _Missing(f"{what} at {remote.uri} or {local.uri}")
        for tier, verification in found.items():
            for result in verification.steps:
                click.echo(f"{tier}: {step_line(result)}")
        healthy = [{result.step for result in found[tier].steps if result.healthy} if tier in found else set()
                   for tier in managers]
        stale = stale_copies(managers, set.intersection(*healthy))  # the steps whose copies verified on both
    for number, why in stale.items():
        click.echo(f"local: step {number}: {why}")
    for verification in found.values():
        check(verification)
    if stale:
        raise CheckpointError(f"{len(stale)} local cop{'y' if len(stale) == 1 else 'ies'} in {local.uri} "
                              f"{'is' if len(stale) == 1 else 'are'} not the committed step of {remote.uri}: "
                              f"step(s) {', '.join(map(str, stale))}")
    total = sum(len(verification.steps) for verification in found.values())
    click.echo(f"{remote.uri} and {local.uri}: {total} step(s) healthy in {time.perf_counter() - started:.2f} s")
    return OK
